"""structlog setup: console by default, JSON with SPECBUS_LOG_JSON=1, ids bound per block."""

import io
import json

import pytest
import structlog

from services.runtime.logs import configure_logging, log_context


@pytest.fixture(autouse=True)
def reset_structlog():
    yield
    structlog.reset_defaults()


def test_json_lines_carry_bound_ids(monkeypatch):
    monkeypatch.setenv("SPECBUS_LOG_JSON", "1")
    out = io.StringIO()
    configure_logging(stream=out)
    log = structlog.get_logger("test")
    with log_context(request_id="r-1", batch_id=7, worker_id=None):
        log.info("step_done", num_accepted=3)
    log.info("idle")
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["event"] == "step_done" and first["level"] == "info"
    assert (first["request_id"], first["batch_id"], first["num_accepted"]) == ("r-1", 7, 3)
    assert "worker_id" not in first
    assert "request_id" not in second and "timestamp" in second


def test_console_is_the_default_and_level_filters(monkeypatch):
    monkeypatch.delenv("SPECBUS_LOG_JSON", raising=False)
    out = io.StringIO()
    configure_logging(level="warning", stream=out)
    log = structlog.get_logger("test")
    with log_context(request_id="r-2"):
        log.info("hidden")
        log.warning("shown")
    text = out.getvalue()
    assert "hidden" not in text
    assert "shown" in text and "request_id=r-2" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_exceptions_are_structured():
    out = io.StringIO()
    configure_logging(json=True, stream=out)
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        structlog.get_logger("test").exception("handler_failed")
    record = json.loads(out.getvalue())
    assert record["level"] == "error"
    assert record["exception"][0]["exc_type"] == "RuntimeError"


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="level"):
        configure_logging(level="loud")


@pytest.mark.parametrize("json_lines", [False, True])
def test_tracebacks_are_bounded_and_carry_no_locals(json_lines):
    """A failed batch's traceback keeps the frames and the error, never the locals (a frame's
    tensors or batch message would make every failure a flood of log)."""
    out = io.StringIO()
    configure_logging(json=json_lines, stream=out)

    def deep(n: int, big_local: str) -> None:
        if n == 0:
            raise ValueError("row 3 failed")
        deep(n - 1, big_local)

    try:
        deep(60, "%s-bytes" % "tensor" * 100_000)  # the source line does not hold the value
    except ValueError:
        structlog.get_logger("test").exception("batch_failed")
    text = out.getvalue()
    assert "row 3 failed" in text and "batch_failed" in text
    assert "tensor-bytes" not in text
    assert len(text) < 20_000, len(text)
