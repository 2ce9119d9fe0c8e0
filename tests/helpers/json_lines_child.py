"""A helper process spoken to in JSON lines: a command per line on its stdin, one JSON answer
line (an object) for each, and for its start, on its stdout; an answer holding ``error`` raises."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import REPO


class JsonLinesChild:
    what = "helper process"  # named in errors

    def _spawn(self, module: str, *args: str, env: dict[str, str]) -> None:
        """``python -m module args...`` in the repository root, stderr discarded."""
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, text=True, bufsize=1,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def _send(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        return self._answer()

    def _answer(self) -> dict:
        """The next answer line; lines that are not a JSON object are skipped (a Ray driver prints
        cluster events, such as a node's death, on its stdout)."""
        while not (line := self.proc.stdout.readline()).startswith("{"):
            if not line:
                raise RuntimeError(f"{self.what} exited with {self.proc.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.what}: {answer['error']}")
        return answer

    def _close(self, timeout_s: float) -> None:
        """EOF on its stdin (it finishes and exits), then killed after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
