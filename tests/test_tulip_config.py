"""`TulipConfig` from flags and TULIP_* environment variables, and its validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tulip.config import ConfigError, TulipConfig, env_name


def test_defaults_match_the_documented_interface() -> None:
    config = TulipConfig.from_args(["--model", "multilingual-e5-small"], {})
    assert (config.host, config.port, config.metrics_port) == ("127.0.0.1", 50051, 9100)
    assert (config.max_batch_tokens, config.max_batch_rows) == (0, 256)  # 0: by device
    assert config.max_queued_tokens == 262144
    assert config.device == "auto" and config.dtype == "auto"
    assert config.cuda_graphs is True and config.drain_seconds == 30.0
    assert config.threads is None and config.model_name == ""


def test_environment_fills_in_and_flags_win() -> None:
    env = {
        "TULIP_MODEL": "/models/e5",
        "TULIP_PORT": "6000",
        "TULIP_MAX_BATCH_TOKENS": "2048",
        "TULIP_CUDA_GRAPHS": "false",
        "TULIP_DRAIN_SECONDS": "2.5",
        "TULIP_THREADS": "3",
        "TULIP_DEVICE": "cuda:1",
        "TULIP_DTYPE": "bfloat16",
        "TULIP_MODEL_NAME": "e5",
    }
    config = TulipConfig.from_args(["--port", "7000", "--cuda-graphs"], env)
    assert config.model == "/models/e5" and config.model_name == "e5"
    assert config.port == 7000  # flag wins over TULIP_PORT
    assert config.max_batch_tokens == 2048
    assert config.cuda_graphs is True  # flag wins over TULIP_CUDA_GRAPHS=false
    assert config.drain_seconds == 2.5 and config.threads == 3
    assert (config.device, config.dtype) == ("cuda:1", "bfloat16")
    assert TulipConfig.from_args(["--model", "m"], {"TULIP_CUDA_GRAPHS": "0"}).cuda_graphs is False
    assert TulipConfig.from_args(["--model", "m", "--no-cuda-graphs"], {}).cuda_graphs is False


def test_env_names() -> None:
    assert env_name("--max-queued-tokens") == "TULIP_MAX_QUEUED_TOKENS"
    assert env_name("--metrics-port") == "TULIP_METRICS_PORT"


@pytest.mark.parametrize(
    ("argv", "env", "key"),
    [
        ([], {}, "--model"),
        (["--model", "m", "--port", "70000"], {}, "--port"),
        (["--model", "m", "--metrics-port", "-1"], {}, "--metrics-port"),
        (["--model", "m", "--device", "tpu"], {}, "--device"),
        (["--model", "m", "--dtype", "int8"], {}, "--dtype"),
        (["--model", "m", "--max-batch-tokens", "-1"], {}, "--max-batch-tokens"),
        (["--model", "m", "--max-batch-rows", "0"], {}, "--max-batch-rows"),
        (["--model", "m", "--max-queued-tokens", "0"], {}, "--max-queued-tokens"),
        (["--model", "m", "--drain-seconds", "-1"], {}, "--drain-seconds"),
        (["--model", "m", "--threads", "0"], {}, "--threads"),
        (["--model", "m"], {"TULIP_PORT": "http"}, "TULIP_PORT"),
        (["--model", "m"], {"TULIP_CUDA_GRAPHS": "maybe"}, "TULIP_CUDA_GRAPHS"),
        (["--model", "m"], {"TULIP_DRAIN_SECONDS": "soon"}, "TULIP_DRAIN_SECONDS"),
    ],
)
def test_invalid_values_name_their_key(argv: list[str], env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TulipConfig.from_args(argv, env)


def test_config_is_frozen() -> None:
    config = TulipConfig(model="m")
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_command_line_reports_bad_configuration_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tulip", "--model", "m"],
        env={"TULIP_MAX_BATCH_ROWS": "0", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--max-batch-rows must be at least 1" in done.stderr


def test_every_default_the_help_states_is_the_configs() -> None:
    """`python -m tulip --help` says "(default X)" for most flags; each X is the dataclass's
    own default (a help string once said 2 s of queue where the server used 1)."""
    import dataclasses
    import re

    from tulip.config import TulipConfig, _parser

    defaults = {f.name: f.default for f in dataclasses.fields(TulipConfig)}
    checked = 0
    for action in _parser()._actions:
        stated = re.search(r"\(default ([^ ;,)]+)\)", action.help or "")
        if stated is None or defaults.get(action.dest) in (None, dataclasses.MISSING):
            continue  # None: resolved from other flags (their help says how)
        want = defaults[action.dest]
        text = stated.group(1)
        if isinstance(want, bool):
            assert text == ("on" if want else "off"), (action.dest, text, want)
        elif isinstance(want, int | float):
            assert float(text) == want, (action.dest, text, want)
        else:
            assert text == str(want), (action.dest, text, want)
        checked += 1
    assert checked >= 10
