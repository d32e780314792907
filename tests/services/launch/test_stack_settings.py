"""What the stack passes each service: torch threads per role from the machine, the KV cache budget,
its ports."""

import dataclasses

import pytest

from schemas.config import NATS_PORT, ROLES, load_config
from services.cli import build_parser
from services.launch.stack import SMALL_MODEL_BYTES, StackConfig, make_log_dir, port_args, role_threads, serve_command


@pytest.mark.parametrize("cores, verifiers, drafters, expected", [
    (2, 1, 1, (2, 2)),    # this project's 2-core machines: draft and verify each have both while they run
    (4, 1, 1, (4, 4)),
    (16, 1, 1, (16, 4)),  # a drafter: at most MAX_DRAFTER_THREADS
    (16, 2, 2, (8, 4)),
    (16, 4, 8, (4, 2)),
    (1, 3, 1, (1, 1)),    # never 0
])
def test_threads_from_the_machine(tmp_path, cores, verifiers, drafters, expected):
    large = big_model_dir(tmp_path)
    config = StackConfig(verifiers=verifiers, drafters=drafters, target_model=str(large), draft_model=str(large))
    assert (role_threads("verifier", config, cores), role_threads("drafter", config, cores)) == expected
    assert all(role_threads(role, config, cores) is None for role in ("scheduler", "postprocessor", "gateway"))


def big_model_dir(tmp_path):
    """A directory whose safetensors file is SMALL_MODEL_BYTES long (sparse: nothing is written)."""
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "model.safetensors", "wb") as file:
        file.truncate(SMALL_MODEL_BYTES)
    return tmp_path / "big"


def test_small_models_and_prompt_lookup_get_one_thread(tmp_path):
    """Their forward is per-op overhead; a second thread would spin on the stack's shared cores."""
    tiny = StackConfig(target_model="models/tiny/target", draft_model="models/tiny/draft")
    assert (role_threads("verifier", tiny, 16), role_threads("drafter", tiny, 16)) == (1, 1)
    large = str(big_model_dir(tmp_path))
    for method, expected in (("ngram", 1), ("eagle", 1), ("model", 4)):  # the shipped head is small
        config = StackConfig(target_model=large, draft_model=large, draft_method=method)
        assert (role_threads("verifier", config, 16), role_threads("drafter", config, 16)) == (16, expected)


def test_given_threads_win():
    config = StackConfig(verifier_threads=3, drafter_threads=2)
    assert (role_threads("verifier", config, 64), role_threads("drafter", config, 64)) == (3, 2)
    with pytest.raises(ValueError, match="verifier_threads: must be >= 0"):
        StackConfig(verifier_threads=-1)


def settings(role: str, config: StackConfig):
    """The config a `serve role` process started by the stack loads (its flags, no environment)."""
    args = build_parser().parse_args(serve_command(role, f"{role}-0", f"nats://127.0.0.1:{NATS_PORT}", config)[3:])
    fields = {f.name for f in dataclasses.fields(ROLES[role])}
    return load_config(ROLES[role], env={}, **{name: value for name, value in vars(args).items() if name in fields})


def test_serve_commands_carry_threads_and_kv_cache_memory():
    config = StackConfig(verifier_threads=2, kv_cache_memory="512MiB")
    verifier, drafter = settings("verifier", config), settings("drafter", config)
    assert (verifier.torch_threads, verifier.kv_cache_memory) == (2, "512MiB")
    assert drafter.kv_cache_memory == "512MiB" and drafter.torch_threads >= 1
    assert settings("verifier", StackConfig()).kv_cache_memory == "2GiB"  # the services' default
    role_args = StackConfig(verifier_threads=2, role_args={"verifier": ["--torch-threads", "1"]})
    assert settings("verifier", role_args).torch_threads == 1  # role_args still win


def test_weights_of_gguf_blocks_go_to_the_verifier_only_and_int8_to_both():
    """--weights is how the verifier holds the target: a draft model has no GGUF blocks, but any
    model can be quantized to int8 at load."""
    config = StackConfig(weights="int8dot")
    assert (settings("verifier", config).weights, settings("drafter", config).weights) == ("int8dot", "auto")
    config = StackConfig(weights="int8")
    assert (settings("verifier", config).weights, settings("drafter", config).weights) == ("int8", "int8")


def test_each_new_instance_gets_the_next_ports_and_a_known_one_keeps_its_own():
    config = StackConfig(metrics_port_base=9100, http_port=8000)
    metrics, gateways = {}, {}
    assert port_args("scheduler", "scheduler-0", config, metrics, gateways) == ["--metrics-port", "9100"]
    assert port_args("gateway", "gateway-0", config, metrics, gateways) == ["--metrics-port", "9101",
                                                                             "--http-port", "8000"]
    assert port_args("gateway", "gateway-1", config, metrics, gateways)[-1] == "8001"
    assert port_args("scheduler", "scheduler-0", config, metrics, gateways) == ["--metrics-port", "9100"]
    assert (metrics, gateways) == ({"scheduler-0": 9100, "gateway-0": 9101, "gateway-1": 9102},
                                   {"gateway-0": 8000, "gateway-1": 8001})
    free = {}
    assert port_args("gateway", "gateway-0", StackConfig(), {}, free)[0] == "--http-port" and free["gateway-0"] > 0
    assert port_args("verifier", "verifier-0", StackConfig(), {}, {}) == []


def test_a_given_log_dir_is_kept_and_a_temporary_one_is_owned(tmp_path):
    assert make_log_dir(tmp_path / "logs") == (tmp_path / "logs", False) and (tmp_path / "logs").is_dir()
    temporary, owned = make_log_dir(None)
    assert owned and temporary.is_dir()
    temporary.rmdir()
