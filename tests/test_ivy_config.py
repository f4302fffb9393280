"""IvyConfig: flags, IVY_* environment fallback, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ivy.config import ConfigError, IvyConfig, parse_config


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_flags_env_and_round_trip(model_dir: Path) -> None:
    env = {
        "IVY_PORT": "9000",
        "IVY_CHUNK_TOKENS": "1024",
        "IVY_MODEL": f"e5={model_dir}",
        "IVY_REPLICAS": "e5=10.0.0.1:50051,10.0.0.2:50051",
        "IVY_API_KEYS": "k1, k2",
        "IVY_TOKENIZER_WORD_CACHE": "0",
    }
    config = parse_config(["--port", "9100"], env)
    assert config.port == 9100  # the flag wins over the environment
    assert config.chunk_tokens == 1024
    assert config.tokenizer_word_cache == 0
    assert config.models == {"e5": str(model_dir)}
    assert config.replicas == {"e5": ("10.0.0.1:50051", "10.0.0.2:50051")}
    assert config.all_api_keys() == {"k1", "k2"}
    assert IvyConfig.from_json(config.to_json()) == config
    dns = parse_config(
        ["--model", f"e5={model_dir}", "--replicas-dns", "e5=tulip.ns.svc:50051"], {}
    )
    assert dns.replicas_dns == {"e5": "tulip.ns.svc:50051"} and not dns.replicas


@pytest.mark.parametrize(
    ("argv", "env", "key"),
    [
        ([], {}, "model"),
        (["--model", "e5"], {}, "model"),
        (["--model", "e5=/nonexistent"], {}, "model"),
        (["--model", "e5=DIR"], {}, "replicas"),
        (["--model", "e5=DIR", "--replicas", "other=h:1"], {}, "replicas"),
        (["--model", "e5=DIR", "--replicas", "e5=nohostport"], {}, "replicas"),
        (["--model", "e5=DIR", "--replicas", "e5=h:1", "--chunk-tokens", "0"], {}, "chunk-tokens"),
        (["--model", "e5=DIR", "--replicas", "e5=h:1", "--port", "70000"], {}, "port"),
        (
            ["--model", "e5=DIR", "--replicas", "e5=h:1", "--tokenizer-word-cache", "-1"],
            {},
            "tokenizer-word-cache",
        ),
        (["--model", "e5=DIR", "--replicas", "e5=h:1"], {"IVY_WORKERS": "two"}, "workers"),
        (
            ["--model", "e5=DIR", "--replicas", "e5=h:1", "--replicas-dns", "e5=svc:1"],
            {},
            "replicas-dns",
        ),
        (
            ["--model", "e5=DIR", "--replicas", "e5=h:1", "--api-keys-file", "/nope"],
            {},
            "api-keys-file",
        ),
    ],
)
def test_errors_name_the_key(model_dir: Path, argv: list[str], env: dict, key: str) -> None:
    argv = [a.replace("DIR", str(model_dir)) for a in argv]
    with pytest.raises(ConfigError) as info:
        parse_config(argv, env)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")
