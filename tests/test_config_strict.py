"""Strict kv_connector_extra_config and transport options (issue 21, "Strict config").

No vLLM server: Settings.from_config and create_transport directly.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest

from kvlink.errors import ConfigError
from kvlink.integrations.vllm.config import Settings
from kvlink.transport import TransportContext, create_transport
from kvlink.worker import WorkerConfig


def _s(extra: dict[str, Any], role: str = "kv_producer") -> Settings:
    return Settings.from_config("E", role, extra)


# ----------------------------------------------------------------------------- top-level keys
def test_typo_top_level_key_fails_with_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'tranport'; did you mean 'transport'\?"):
        _s({"tranport": "nixl"})


def test_unknown_key_without_a_close_match_lists_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; known: .*kv_lease_duration"):
        _s({"zzz": 1})


def test_bad_number_names_key_and_value() -> None:
    with pytest.raises(ConfigError,
                       match=r"^kv_lease_duration: expected a number, got 'abc'$"):
        _s({"kv_lease_duration": "abc"})
    with pytest.raises(ConfigError, match=r"^side_channel_port: expected an integer"):
        _s({"side_channel_port": "x"})
    with pytest.raises(ConfigError, match=r"^allow_insecure: expected true or false, got 'no'"):
        _s({"allow_insecure": "no"})
    with pytest.raises(ConfigError, match=r"^grants: expected true or false, got 'false'"):
        _s({"grants": "false"})


def test_numeric_strings_still_read_as_numbers() -> None:
    # float()/int() read these before: keep them working
    s = _s({"kv_lease_duration": "5", "side_channel_port": "5700", "idle_yield_ms": 1})
    assert (s.lease_seconds, s.side_port, s.idle_yield_s) == (5.0, 5700, 0.001)


def test_mode_message_unchanged() -> None:
    with pytest.raises(ConfigError, match=r"mode must be one of \['pull', 'push'\], got 'write'"):
        _s({"mode": "write"}, "kv_consumer")


def test_grants_reaches_settings() -> None:
    assert _s({}).grants is True
    assert _s({"grants": False}).grants is False


def test_grants_reaches_worker_config() -> None:
    from kvlink.integrations.vllm import worker as vllm_worker

    assert vllm_worker.PullWorker(_s({"grants": False}), 0, 1).worker_config().grants is False
    assert vllm_worker.PullWorker(_s({}), 0, 1).worker_config().grants is True


def test_the_renewal_limit_reaches_the_worker_and_must_be_positive() -> None:
    from kvlink.integrations.vllm import worker as vllm_worker

    cfg = vllm_worker.PullWorker(_s({"kv_lease_renew_limit": 45}), 0, 1).worker_config()
    assert cfg.renew_limit == 45.0
    assert vllm_worker.PullWorker(_s({}), 0, 1).worker_config().renew_limit == 600.0
    with pytest.raises(ConfigError, match="kv_lease_renew_limit must be positive, got 0"):
        _s({"kv_lease_renew_limit": 0})


# ----------------------------------------------------------------------------- transport options
def test_tcp_option_typo_fails_in_settings() -> None:
    with pytest.raises(ConfigError, match=r"tcp transport: unknown option 'timeout'; "
                                          r"did you mean 'timeout_s'\?"):
        _s({"transport_options": {"tcp": {"timeout": 5}}})


@pytest.mark.parametrize("transport,key", [("tcp", "timeout_s"), ("tcp", "hello_timeout_s"),
                                           ("nixl", "timeout_s"), ("mooncake", "timeout_s")])
@pytest.mark.parametrize("value", [0, -1, "-2"])
def test_a_deadline_must_be_positive(transport: str, key: str, value: Any) -> None:
    """Refused where it is written (before: tcp took timeout_s=-1, and its peer thread died
    on the socket timeout at the first READ, which then never ended)."""
    with pytest.raises(ConfigError, match=rf"{transport} option {key}: expected a number > 0, "
                                          rf"got {value!r}"):
        _s({"transport_options": {transport: {key: value}}})


@pytest.mark.parametrize("transport,key,value,bound", [
    ("tcp", "max_unauthenticated", 0, ">= 1"),  # its accept thread died evicting from none
    ("tcp", "max_connections", 0, ">= 1"),  # every connection refused, the client not told
    ("tcp", "staging_chunk", 0, ">= 4096"),  # a ZeroDivisionError under a staged transfer
    ("tcp", "staging_buffers", 1, ">= 2"),
    ("tcp", "port", 70000, ">= 0 and <= 65535"),
    ("nixl", "num_threads", -1, ">= 0"),
    ("mooncake", "sub_batch", 0, ">= 1"),
    ("mooncake", "max_retries", 31, ">= 0 and <= 30"),
    ("mooncake", "retry_backoff_s", -0.5, ">= 0"),
    ("cuda_ipc", "piece_extents", 0, ">= 1"),
])
def test_option_bounds_are_checked_with_the_config(transport: str, key: str, value: Any,
                                                  bound: str) -> None:
    """Refused where the config is read (the connector's settings, a WorkerConfig's
    register()), naming the bound. Before, these were taken and broke the transport later
    (comments), or register() skipped the transport at INFO and ran on the next one."""
    with pytest.raises(ConfigError, match=rf"{transport} option {key}: expected .*{bound}"):
        _s({"transport_options": {transport: {key: value}}})


def test_register_refuses_a_bad_option_instead_of_skipping_the_transport() -> None:
    """A ConfigError from register(), not the transport skipped at INFO (and, with it the
    only one, a TransportUnavailable that read as a missing library)."""
    from kvlink.demo import data
    from kvlink.worker import KVWorker

    geo = data.Geometry(layers=1, kv_heads=1, head_dim=8, block_size=4)
    _buf, layers = data.allocate(geo, 4, 1, 0)
    worker = KVWorker(WorkerConfig(engine_id="bad-opt",
                                   transport_options={"tcp": {"max_connections": 0}}))
    with pytest.raises(ConfigError, match="tcp option max_connections"):
        worker.register(data.spec_of(geo, layers, 1, 0))
    worker.close()


def test_tcp_option_typo_fails_in_create_transport() -> None:
    with pytest.raises(ConfigError, match=r"tcp transport: unknown option 'timeout'; "
                                          r"did you mean 'timeout_s'\?"):
        create_transport("tcp", TransportContext(agent_name="strict/0/0"), {"timeout": 5})


def test_tcp_option_bad_type_names_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"tcp option timeout_s: expected a number > 0, got 'x'"):
        create_transport("tcp", TransportContext(agent_name="strict/0/1"), {"timeout_s": "x"})
    with pytest.raises(ConfigError, match=r"tcp option stage_host_memory: expected true or "
                                          r"false, got 'false'"):
        _s({"transport_options": {"tcp": {"stage_host_memory": "false"}}})


def test_tcp_valid_options_still_create() -> None:
    t = create_transport("tcp", TransportContext(agent_name="strict/0/2"),
                         {"timeout_s": 8.0, "port": 0, "stage_host_memory": True})
    try:
        assert t.timeout == 8.0  # type: ignore[attr-defined]
    finally:
        t.close()


def test_tcp_takes_its_defaults_from_the_schema() -> None:
    """The schema (kvlink.options.TcpOptions) is where a tcp option's default is said, once:
    a transport made without options runs with those. (It did not: the transport read each
    with a default of its own, and turning ``reader_in_c`` on in the schema left it off.)"""
    from kvlink import options

    t = create_transport("tcp", TransportContext(agent_name="strict/0/3"), {})
    try:
        assert t.options == options.defaults("tcp")
        assert t.reader_in_c is options.defaults("tcp")["reader_in_c"]  # type: ignore[attr-defined]
        assert t.timeout == options.defaults("tcp")["timeout_s"]  # type: ignore[attr-defined]
    finally:
        t.close()


def test_a_negative_socket_buffer_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"socket_buffer_bytes must be >= 0.*-1"):
        create_transport("tcp", TransportContext(agent_name="strict/0/4"),
                         {"socket_buffer_bytes": -1})


@pytest.mark.parametrize(("name", "module", "attr"), [
    ("nixl", "nixl", "_timeout"), ("mooncake", "mooncake", "timeout"),
])
def test_nixl_and_mooncake_take_their_defaults_from_the_schema(
        monkeypatch: pytest.MonkeyPatch, name: str, module: str, attr: str) -> None:
    """Like tcp's: a default changed in the schema is the one the transport runs with (each
    read its own ``.get(key, default)`` before, which agreed with the schema only by care).
    The schema is swapped for one with another default (monkeypatch): nothing is faked, the
    real transport is made and read."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    from kvlink import options

    class Changed(options.SCHEMAS[name]):  # type: ignore[misc,valid-type]
        timeout_s: float = 7.5

    monkeypatch.setitem(options.SCHEMAS, name, Changed)
    t = create_transport(name, TransportContext(agent_name=f"defaults-{name}",
                                                advertise_host="127.0.0.1"), {})
    try:
        assert getattr(t, attr) == 7.5
    finally:
        t.close()


@pytest.mark.parametrize(("name", "bad", "near"), [
    ("nixl", "backend", "backends"), ("nixl", "num_thread", "num_threads"),
    ("mooncake", "protocl", "protocol"), ("cuda_ipc", "kernal", "kernel"),
])
def test_option_typo_each_transport(name: str, bad: str, near: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name} transport: unknown option '{bad}'; "
                                          rf"did you mean '{near}'\?"):
        _s({"transport": name, "transport_options": {name: {bad: 1}}})


@pytest.mark.parametrize(("name", "module"), [("nixl", "nixl"), ("mooncake", "mooncake")])
def test_option_typo_fails_in_create_transport(name: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    with pytest.raises(ConfigError, match=rf"{name} transport: unknown option 'bogus'"):
        create_transport(name, TransportContext(agent_name=f"strict-{name}",
                                                advertise_host="127.0.0.1"), {"bogus": 1})


def test_transport_options_for_an_unknown_name_fail() -> None:
    with pytest.raises(ConfigError, match=r"transport_options: 'ncl' is neither .*did you mean "
                                          r"'nixl'\?"):
        _s({"transport_options": {"ncl": {}}})


def test_none_means_unset_for_computed_defaults() -> None:
    s = _s({"transport": "mooncake", "transport_options": {"mooncake": {"sub_batch": None}}})
    assert s.transport_options["mooncake"] == {}


def test_schemas_match_defaults() -> None:
    from kvlink import options

    assert options.defaults("tcp")["timeout_s"] == 30.0
    assert options.defaults("nixl")["backends"] == ["UCX"]
    assert options.defaults("mooncake")["protocol"] == "tcp"
    assert options.defaults("cuda_ipc")["kernel"] == "auto"


# ----------------------------------------------------------------------------- other connectors
def test_nixl_connector_backends_select_nixl() -> None:
    s = _s({"backends": ["UCX"]})
    assert s.transports == ("nixl",)
    assert s.transport_options["nixl"] == {"backends": ["UCX"]}


def test_nixl_connector_num_threads() -> None:
    s = _s({"transport": ["nixl", "tcp"], "backends": ["UCX"], "num_threads": 4})
    assert s.transports == ("nixl", "tcp")
    assert s.transport_options["nixl"] == {"backends": ["UCX"], "num_threads": 4}


def test_nixl_connector_key_with_another_transport_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'backends' is NixlConnector's key for kvlink's "
                                          r"nixl transport, but transport is \['tcp'\]"):
        _s({"transport": "tcp", "backends": ["UCX"]})
    with pytest.raises(ConfigError, match=r"'num_threads' is NixlConnector's key"):
        _s({"transport": "tcp", "num_threads": 8})


def test_nixl_connector_key_disagreeing_with_transport_options() -> None:
    with pytest.raises(ConfigError, match=r"disagrees with transport_options.nixl.backends"):
        _s({"backends": ["UCX"], "transport_options": {"nixl": {"backends": ["GDS"]}}})


def test_mooncake_connector_protocol() -> None:
    s = _s({"mooncake_protocol": "rdma", "device_name": "mlx5_0"})
    assert s.transports == ("mooncake",)
    assert s.transport_options["mooncake"] == {"protocol": "rdma", "device_name": "mlx5_0"}
    with pytest.raises(ConfigError, match=r"mooncake_protocol: expected one of 'tcp', 'rdma', "
                                          r"got 'udp'"):
        _s({"mooncake_protocol": "udp"})


@pytest.mark.parametrize(("key", "hint"), [
    ("kv_recompute_threshold", "no kvlink equivalent"),
    ("bidirectional_kv_xfer", r"mode: \"push\""),
    ("decoder_kv_blocks_ttl", "push_timeout"),
    ("num_workers", "MooncakeConnector"),
    ("bootstrap_server_address", "side_channel_host"),
])
def test_other_connectors_keys_refused(key: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' is not a kvlink key: .*{hint}"):
        _s({key: 1})


# ----------------------------------------------------------------------------- valid configs
def test_empty_config_defaults() -> None:
    s = _s({})
    assert s.transports == ("tcp",) and s.mode == "pull" and s.side_port == 5600
    assert s == Settings.from_config("E", "kv_producer", None)


def test_env_fallbacks_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5900")
    s = _s({})
    assert (s.host, s.side_port) == ("127.0.0.1", 5900)


def test_aliases() -> None:
    s = _s({"transports": "nixl,tcp", "lease_seconds": 7})
    assert s.transports == ("nixl", "tcp") and s.lease_seconds == 7.0
    with pytest.raises(ConfigError, match="disagree"):
        _s({"transport": "tcp", "transports": "nixl"})


FULL: dict[str, Any] = {
    "transport": ["nixl", "tcp"],
    "transport_options": {"tcp": {"timeout_s": 8.0, "staging_buffers": 4},
                          "nixl": {"backends": ["UCX"], "progress_thread": True,
                                   "post_mode": "direct"},
                          "mooncake": {"protocol": "rdma"}, "cuda_ipc": {"chunk_bytes": 1 << 20}},
    "side_channel_host": "10.0.0.5", "side_channel_port": 5700, "advertise_host": "pf.example",
    "kv_lease_duration": 45.0, "read_pin_seconds": 20.0, "kv_lease_renew_limit": 300.0,
    "handshake_timeout": 3.0,
    "read_intent_timeout": 4.0, "idle_yield_ms": 5.0, "secret": "s3cret",
    "allow_insecure": False, "mode": "push", "push_timeout": 12.0, "grants": False,
    "integrity": "off", "hold_board": False, "landing_board": False, "poll_grace_us": 50.0,
    "sync_load_tokens": 256, "sync_load_ms": 1.5, "layerwise": True, "layerwise_min_tokens": 256,
    "layerwise_wait_ms": 20.0,
}


def test_full_config_round_trips() -> None:
    s = Settings.from_config("E", "kv_both", FULL)
    assert s.transports == ("nixl", "tcp") and s.mode == "push" and s.grants is False
    assert s.hold_board is False and s.landing_board is False
    assert s.lease_seconds == 45.0 and s.idle_yield_s == 0.005 and s.side_port == 5700
    assert s.transport_options["tcp"] == {"timeout_s": 8.0, "staging_buffers": 4}
    again = s.to_config()
    assert again == FULL
    assert Settings.from_config("E", "kv_both", again) == s


def test_docs_examples_parse() -> None:
    _s({"transport": "tcp"})
    _s({"transport": "tcp", "mode": "push", "side_channel_port": 5700}, "kv_consumer")
    _s({"side_channel_port": 5601, "kv_lease_duration": 0.5})
    _s({"transport_options": {"nixl": {"progress_thread": True}}, "transport": "nixl"})


def test_integrity_is_checked_naming_its_key() -> None:
    assert _s({"integrity": "sample"}).integrity == "sample"
    with pytest.raises(ConfigError, match=r"integrity must be one of .*got 'ful'"):
        _s({"integrity": "ful"})
    assert _s({"integrity": "full", "mode": "push"}, "kv_consumer").integrity == "full"


def test_out_of_range_values_are_refused_where_they_are_written() -> None:
    """Refused when the config is made, naming the value (before: poll_grace_us only when a
    worker was made from the settings; side_port only at bind, as an OverflowError)."""
    with pytest.raises(ConfigError, match=r"poll_grace_us must be 0 to 1e6 .* got 2000000"):
        _s({"poll_grace_us": 2_000_000})
    with pytest.raises(ConfigError, match=r"poll_grace_us .* got -1"):
        _s({"poll_grace_us": -1})
    with pytest.raises(ConfigError, match=r"side_port must be 0 .* to 65535 .* got 70000"):
        WorkerConfig(engine_id="e", side_port=70000)
    with pytest.raises(ConfigError, match=r"side_port must be 0 .* to 65534 \(tp_size 2\)"):
        WorkerConfig(engine_id="e", side_port=65535, tp_size=2)


def test_the_connector_docs_list_every_transport_option() -> None:
    """docs/vllm.md's table of transport_options names every option each built-in
    transport's schema takes (it had drifted: nine were missing)."""
    from pathlib import Path

    from kvlink import options

    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in doc.splitlines()
            if line.startswith("| `") and line.count("|") == 3}
    for name, schema in options.SCHEMAS.items():
        missing = [k for k in options.field_types(schema) if f"`{k}`" not in rows.get(name, "")]
        assert not missing, f"docs/vllm.md's {name} row lacks {missing}"


@pytest.mark.parametrize("kw,named", [
    ({"handshake_timeout": "5"}, "WorkerConfig.handshake_timeout: expected float, got '5'"),
    ({"side_port": "5000"}, "WorkerConfig.side_port: expected int, got '5000'"),
    ({"tp_rank": True}, "WorkerConfig.tp_rank: expected int, got True"),
    ({"transports": "tcp"}, "WorkerConfig.transports: expected list[str], got 'tcp'"),
    ({"secret": 3}, "WorkerConfig.secret: expected str | None, got 3"),
])
def test_worker_config_fields_of_another_type_are_named(kw: dict[str, Any], named: str) -> None:
    """A ConfigError naming the field (before: a TypeError from a comparison, or a failure
    later — transports="tcp" tried transports "t", "c", "p")."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        WorkerConfig(engine_id="e", **kw)
