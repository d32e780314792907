"""ops/compose_check.py's pure parts: the mirror it gives debootstrap, how streams are judged,
the summary line. The check itself needs root and Docker (`make compose-check`)."""

import pytest

from ops.compose_check import Failed, debian_mirror, outcomes, summary


def test_the_mirror_comes_from_the_suites_stanza_of_a_deb822_file(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\n# a comment: with a colon\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n")
    assert debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_the_mirror_comes_from_a_sources_list_line_with_options(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://old.example/debian bookworm main\n")
    assert debian_mirror(tmp_path) == "http://old.example/debian"


def test_no_mirror_of_the_suite_says_so(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb http://old.example/debian bullseye main\n")
    with pytest.raises(Failed, match="no Debian bookworm mirror"):
        debian_mirror(tmp_path)


def test_a_stream_is_identical_only_when_it_finished_with_the_reference_tokens():
    reference = [[1, 2, 3]] * 4
    streamed = [([1, 2, 3], "finished"), ([1, 2, 3], "finished, failover"), ([1, 2], "finished"),
                ([1], "StreamBroken: gone")]
    assert outcomes(streamed, reference) == {"identical": 1, "identical, failover": 1,
                                             "different output (2 tokens)": 1, "StreamBroken: gone": 1}


def test_the_summary_of_a_failure_is_its_first_line():
    assert summary({"total_s": 75.0, "error": "dockerd did not answer\nlog tail"}) == \
        "compose-check: FAILED after 1m15s: dockerd did not answer"
