"""A real ``redis-server`` process on a free loopback port, for the serving tests (see ``conftest.py``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import redis

from dynemb.distributed.launch import free_port  # a port below the ephemeral range

_START_TIMEOUT_S = 10.0


class RedisServer:
    """A ``redis-server`` process on 127.0.0.1 that tests can stop, pause and restart on the same port."""

    def __init__(self, workdir: str, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install it with scripts/install_system_deps.sh")
        self.binary, self.workdir, self.password = binary, workdir, password
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self.workdir] + (["--requirepass", self.password] if self.password else [])
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                self.client().ping()
                return
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on {self.address}") from None
                time.sleep(0.02)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Stop the server at once (SIGKILL): its data is lost, connections break."""
        if self.running():
            self.process.kill()
        if self.process is not None:
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)
