"""`kvserve bench agents` refuses bad arguments and an absent gateway with exit code 2, before any load."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_processes import free_port

from loadgen.agents_cli import main

TRACES = str(Path(__file__).parent / "data" / "claude_code")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agents", "0"], "--agents needs positive counts"),
        (["--agents", "2,x"], "invalid literal"),
        (["--think-time", "soon"], "--think-time takes seconds"),
        (["--think-time", "-1"], "must not be negative"),
        (["--trace-path", "/nonexistent/traces"], "No such file"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace-path", TRACES, *args]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_no_gateway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.json"
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--trace-path", TRACES, "--out", str(out)]) == 2
    assert "did not answer" in capsys.readouterr().err and not out.exists()
