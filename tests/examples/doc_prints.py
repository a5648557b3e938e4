"""What a docs ```python block prints must be what its comments say: the convention, and the check.

Every ``print(...)`` statement of a block that runs shows its output in a comment:

- on the statement's last line: ``print(x.tolist())  # [3, 1, 3]``;
- or, when that line has none, on the comment lines right after the statement, one per printed line::

      print(plan)
      # {'ad': Sharding('table', owner=0)}

The comment is the printed text, exactly, except that ``...`` matches any text (doctest's ELLIPSIS:
``# [[1.2649..., 1.0]]``); it may go on with ``: `` and prose (``# [3, 1, 3]: negative keys included``). A print
that runs several times (in a loop) must match its comment each time.

Run as a script (``python doc_prints.py BLOCK.py``, under torchrun too), it runs one block and exits 1 with the
mismatches on stderr.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field


@dataclass
class Print:
    """One print statement of a block: its lines (1-based, in the block) and the output its comment shows."""

    first: int
    last: int
    expected: str | None
    outputs: list[str] = field(default_factory=list)


def prints_of(code: str) -> list[Print]:
    """The print statements of ``code`` with the output their comments show (``None``: no comment)."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    found = []
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            continue
        if node.end_lineno in comments:
            shown = [comments[node.end_lineno]]
        else:  # the comment lines right after it
            shown, line = [], node.end_lineno + 1
            while line in comments and line not in code_lines:
                shown.append(comments[line])
                line += 1
        text = "\n".join(re.sub(r"^#\s?", "", c) for c in shown) if shown else None
        found.append(Print(node.lineno, node.end_lineno, text))
    return sorted(found, key=lambda p: p.first)


def matches(expected: str, printed: str) -> bool:
    """Whether ``printed`` is ``expected`` (``...`` matching any text), alone or before ``: `` and prose."""
    for cut in [len(expected)] + [m.start() for m in re.finditer(": ", expected)]:
        pattern = ".*?".join(re.escape(part) for part in expected[:cut].split("..."))
        if re.fullmatch(pattern, printed, re.S):
            return True
    return False


def run_block(code: str, filename: str, namespace: dict) -> list[Print]:
    """Run ``code`` in ``namespace`` with its prints recorded (and still printed); returns its print statements
    with what each printed."""
    statements = prints_of(code)

    def recording_print(*args, file=None, **kwargs):
        if file is not None and file is not sys.stdout:
            return builtins.print(*args, file=file, **kwargs)
        buffer = io.StringIO()
        builtins.print(*args, file=buffer, **kwargs)
        text = buffer.getvalue()
        sys.stdout.write(text)
        caller = sys._getframe(1)
        if caller.f_code.co_filename == filename:
            for p in statements:
                if p.first <= caller.f_lineno <= p.last:
                    p.outputs.append(text.removesuffix("\n"))
                    break

    namespace["print"] = recording_print
    try:
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - our own docs
    finally:
        namespace.pop("print", None)
    return statements


def mismatches(statements: list[Print], where: str, first_line: int = 1, every_print_runs: bool = True) -> list[str]:
    """What disagrees with the convention: prints without a comment, outputs unlike their comment, and (with
    ``every_print_runs``) commented prints that never ran. ``first_line``: the block's first line in its file."""
    problems = []
    for p in statements:
        at = f"{where} line {first_line + p.first - 1}"
        if p.expected is None:
            problems.append(f"{at}: print(...) has no comment showing what it prints")
        elif not p.outputs and every_print_runs:
            problems.append(f"{at}: print(...) never ran, so its comment {p.expected!r} is unchecked")
        for out in p.outputs:
            if p.expected is not None and not matches(p.expected, out):
                problems.append(f"{at}: printed {out!r}, but its comment shows {p.expected!r}")
    return problems


if __name__ == "__main__":  # one block, as a script: under torchrun each rank checks what it prints
    path = sys.argv[1]
    code = open(path).read()
    sys.argv = sys.argv[1:]
    ran = run_block(code, path, {"__name__": "__main__", "__file__": path})
    problems = mismatches(ran, path, every_print_runs=False)
    print(f"doc prints checked: {sum(len(p.outputs) for p in ran)}", file=sys.stderr)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(1)
