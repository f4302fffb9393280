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


def test_require_api_keys_refuses_to_start_without_a_key(model_dir: Path, tmp_path: Path) -> None:
    base = ["--model", f"e5={model_dir}", "--replicas", "e5=h:1"]
    assert parse_config(base, {}).require_api_keys is False  # local runs stay open by default
    for argv, env in (
        ([*base, "--require-api-keys"], {}),
        (base, {"IVY_REQUIRE_API_KEYS": "true"}),
        (base, {"IVY_REQUIRE_API_KEYS": "1", "IVY_API_KEYS": " , "}),
        ([*base, "--require-api-keys", "--api-keys-file", str(tmp_path / "empty")], {}),
    ):
        (tmp_path / "empty").write_text("# no keys yet\n")
        with pytest.raises(ConfigError) as info:
            parse_config(argv, env)
        assert info.value.key == "require-api-keys"
        assert "IVY_API_KEYS" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config(base, {"IVY_REQUIRE_API_KEYS": "maybe"})
    assert info.value.key == "require-api-keys"
    keys_file = tmp_path / "keys"
    keys_file.write_text("k3\n")
    assert parse_config(
        base, {"IVY_REQUIRE_API_KEYS": "true", "IVY_API_KEYS": "k1"}
    ).require_api_keys
    from_file = parse_config([*base, "--require-api-keys", "--api-keys-file", str(keys_file)], {})
    assert from_file.require_api_keys and from_file.all_api_keys() == {"k3"}
    # The flag wins over the environment.
    no = parse_config([*base, "--no-require-api-keys"], {"IVY_REQUIRE_API_KEYS": "true"})
    assert no.require_api_keys is False
    round_trip = parse_config([*base, "--require-api-keys"], {"IVY_API_KEYS": "k1"})
    assert IvyConfig.from_json(round_trip.to_json()) == round_trip


def test_main_exits_2_naming_the_key(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ivy.__main__ import main

    monkeypatch.delenv("IVY_API_KEYS", raising=False)
    monkeypatch.setenv("IVY_REQUIRE_API_KEYS", "true")
    assert main(["--model", f"e5={model_dir}", "--replicas", "e5=h:1"]) == 2
    assert "require-api-keys:" in capsys.readouterr().err


def test_shutdown_outlasts_the_longest_request(model_dir: Path) -> None:
    from ivy.config import SHUTDOWN_MARGIN_SECONDS

    base = ["--model", f"e5={model_dir}", "--replicas", "e5=h:1"]
    default = parse_config(base, {})
    assert default.shutdown_seconds == 600.0 + SHUTDOWN_MARGIN_SECONDS
    short = parse_config(
        [*base, "--request-timeout-seconds", "20", "--generation-timeout-seconds", "8"], {}
    )
    assert short.shutdown_seconds == 20.0 + SHUTDOWN_MARGIN_SECONDS


def test_contextualized_limits_come_from_the_config(model_dir: Path) -> None:
    from ivy.config import PERPLEXITY_LIMITS, context_limits

    base = ["--model", f"m={model_dir}", "--replicas", "m=127.0.0.1:1"]
    assert context_limits(parse_config(base, {})) == PERPLEXITY_LIMITS
    assert PERPLEXITY_LIMITS.documents == 512 and PERPLEXITY_LIMITS.request_tokens == 120_000
    config = parse_config([*base, "--max-documents", "8"], {"IVY_MAX_CHUNKS": "20"})
    limits = context_limits(config)
    assert (limits.documents, limits.chunks, limits.document_tokens) == (8, 20, 32_768)
    with pytest.raises(ConfigError, match="^max-request-tokens: must be >= 1"):
        parse_config([*base, "--max-request-tokens", "0"], {})


def test_trellis_up_divides_the_cores_among_its_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas whose torch threads add up to more than the cores stall one another's
    passes (OpenMP workers spin for partners that are not running), so `trellis up` never
    lays them out that way unless told to, and then it says so."""
    import os

    from ivy.cluster import ClusterConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert (ClusterConfig().replicas, ClusterConfig().threads()) == (1, 4)
    assert ClusterConfig(replicas=2).threads() == 2
    assert ClusterConfig(replicas=3).threads() == 1
    assert not any(ClusterConfig(replicas=n).oversubscribed() for n in (1, 2, 3, 4))
    assert ClusterConfig(replicas=8).threads() == 1  # at least one each ...
    assert ClusterConfig(replicas=8).oversubscribed()  # ... which is then too many
    assert ClusterConfig(replicas=2, threads_per_replica=3).threads() == 3
    assert ClusterConfig(replicas=2, threads_per_replica=3).oversubscribed()
