"""WeDLM decoding defaults stored in generation_config.json: round trip, HF keys kept, typos refused."""

import json

import pytest

from megatron_wedlm.decoding.generation_defaults import read_decoding_defaults, write_decoding_defaults


def test_written_settings_read_back_and_hf_keys_survive(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "do_sample": False}))
    write_decoding_defaults(tmp_path, {"window_size": 16, "entropy_threshold": 0.3})
    write_decoding_defaults(tmp_path, {"distance_penalty": 0.05})

    assert read_decoding_defaults(tmp_path) == {"window_size": 16, "entropy_threshold": 0.3, "distance_penalty": 0.05}
    data = json.loads((tmp_path / "generation_config.json").read_text())
    assert data["eos_token_id"] == 7 and data["do_sample"] is False
    assert not list(tmp_path.glob("*.tmp"))


def test_model_without_generation_config_has_no_defaults(tmp_path):
    assert read_decoding_defaults(tmp_path) == {}


@pytest.mark.parametrize(
    "section, message",
    [
        ({"window_sise": 16}, "unknown WeDLM decoding setting"),
        ({"window_size": 0}, "window_size must be >= 1"),
        ({"window_size": 16.0}, "wrong type"),
        ({"distance_penalty": True}, "must be a number"),
        ({"entropy_threshold": float("nan")}, "must be finite"),
    ],
)
def test_bad_stored_settings_are_refused_with_the_file_named(tmp_path, section, message):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"wedlm": section}))
    with pytest.raises(ValueError, match=message) as info:
        read_decoding_defaults(tmp_path)
    assert str(path) in str(info.value)


def test_unreadable_generation_config_is_an_error_not_a_silent_fallback(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the generation config"):
        read_decoding_defaults(tmp_path)
