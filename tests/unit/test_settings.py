"""Settings: layering, validation that names the key and the range, all-or-nothing patches."""

from __future__ import annotations

import pytest

from residency import settings as st


def test_defaults_are_valid() -> None:
    s = st.build({})
    assert s.pool.max_loaded_models == 1
    assert s.pool.llm_pool_autosize is True
    assert s.pool.auto_evict is False
    assert s.pool.auto_evict_threshold == 0.9


@pytest.mark.parametrize("bad", [0, -2, -100])
def test_max_loaded_models_rejects_zero_and_below_minus_one(bad: int) -> None:
    with pytest.raises(st.SettingsError) as e:
        st.build({"pool": {"max_loaded_models": bad}})
    assert "pool.max_loaded_models" in e.value.problems
    assert "-1 (unlimited) or >= 1" in e.value.problems["pool.max_loaded_models"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("auto_evict_threshold", 0.0),
        ("auto_evict_threshold", 1.5),
        ("max_queue_per_model", 0),
        ("load_timeout_s", -1),
    ],
)
def test_out_of_range_names_the_key(key: str, value: object) -> None:
    with pytest.raises(st.SettingsError) as e:
        st.build({"pool": {key: value}})
    assert f"pool.{key}" in e.value.problems


def test_unknown_key_is_an_error_not_ignored() -> None:
    with pytest.raises(st.SettingsError) as e:
        st.build({"pool": {"max_loaded_modles": 2}})
    assert e.value.problems == {"pool.max_loaded_modles": "unknown key"}


def test_layers_later_wins_key_by_key() -> None:
    s = st.build(
        {"pool": {"max_loaded_models": 2, "auto_evict": True}},
        {"pool": {"max_loaded_models": 3}},
    )
    assert s.pool.max_loaded_models == 3
    assert s.pool.auto_evict is True


def test_env_layer_parses_values_and_rejects_unknown() -> None:
    env = {
        "RESIDENCY_POOL_MAX_LOADED_MODELS": "4",
        "RESIDENCY_POOL_AUTO_EVICT": "true",
        "OTHER": "x",
    }
    layer = st.env_layer(env)
    assert layer == {"pool": {"max_loaded_models": 4, "auto_evict": True}}
    with pytest.raises(st.SettingsError) as e:
        st.env_layer({"RESIDENCY_POOL_NOPE": "1"})
    assert "RESIDENCY_POOL_NOPE" in e.value.problems


def test_model_spec_validation() -> None:
    s = st.build({"models": {"a": {"path": "/m/a.gguf", "n_ctx": 512}}})
    assert s.models["a"].type == "llm"
    with pytest.raises(st.SettingsError) as e:
        st.build({"models": {"a": {"path": "/m/a.gguf", "type": "classifier"}}})
    assert "models.a.type" in e.value.problems
    with pytest.raises(st.SettingsError) as e:
        st.build({"models": {"bad/name": {"path": "/m/a.gguf"}}})
    assert "models" in e.value.problems


def test_patch_is_all_or_nothing_and_names_every_bad_key() -> None:
    cur = st.build({})
    with pytest.raises(st.SettingsError) as e:
        st.validate_patch(
            cur,
            {
                "pool": {"max_loaded_models": 0, "auto_evict": True, "nope": 1},
                "server": {"port": 9000},
            },
        )
    assert set(e.value.problems) == {"pool.nope", "server.port", "pool.max_loaded_models"}
    with pytest.raises(st.SettingsError) as e:
        st.validate_patch(cur, {"pool": {"max_loaded_models": 0, "auto_evict": True}})
    assert set(e.value.problems) == {"pool.max_loaded_models"}
    assert st.validate_patch(cur, {"pool": {"max_loaded_models": 2}}) == {
        "pool.max_loaded_models": 2
    }


def test_every_key_declares_when_it_applies() -> None:
    meta = st.key_meta()
    assert meta["pool.max_loaded_models"]["applies"] == st.LIVE
    assert meta["server.port"]["applies"] == st.RESTART
    assert {m["applies"] for m in meta.values()} <= {st.LIVE, st.NEXT_LOAD, st.RESTART}


@pytest.mark.parametrize("dotted", ["server.model_dirs", "debug.fault_injection"])
def test_security_keys_are_restart_only_and_refused_by_a_patch(dotted: str) -> None:
    assert st.key_meta()[dotted]["applies"] == st.RESTART
    assert st.is_restart_only(dotted)
    section, key = dotted.split(".")
    value: object = ["/"] if key == "model_dirs" else True
    with pytest.raises(st.SettingsError) as e:
        st.validate_patch(st.build({}), {section: {key: value}})
    assert list(e.value.problems) == [dotted]
    assert "restart-only" in e.value.problems[dotted]
    assert not st.is_restart_only("pool.max_loaded_models")


def test_api_key_env_must_carry_the_remote_prefix() -> None:
    remote = {"base_url": "http://10.0.0.5/v1"}
    ok = st.build({"models": {"r": {**remote, "api_key_env": "RESIDENCY_REMOTE_OPENAI"}}})
    assert ok.models["r"].api_key_env == "RESIDENCY_REMOTE_OPENAI"
    for bad in ("RESIDENCY_ADMIN_KEY", "OPENAI_API_KEY", "RESIDENCY_REMOTE_"):
        with pytest.raises(st.SettingsError) as e:
            st.build({"models": {"r": {**remote, "api_key_env": bad}}})
        assert "RESIDENCY_REMOTE_" in e.value.problems["models.r.api_key_env"]
    # An entry stored before the rule still reads (the forwarder refuses to use it).
    stored = st.ModelSpec.model_validate(
        {**remote, "api_key_env": "OPENAI_API_KEY"}, context={st.STORED: True}
    )
    assert stored.api_key_env == "OPENAI_API_KEY"


def test_flash_attention_defaults_to_llama_cpps_choice_and_names_a_bad_value() -> None:
    s = st.build({"models": {"a": {"path": "/m/a.gguf"}}})
    assert s.models["a"].flash_attn == "auto"
    with pytest.raises(st.SettingsError) as e:
        st.build({"models": {"a": {"path": "/m/a.gguf", "flash_attn": "maybe"}}})
    assert "models.a.flash_attn" in e.value.problems
