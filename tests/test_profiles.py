"""Quant profiles: the shipped ones load and quantize; a broken one names its file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_quantize import synthetic_f16  # noqa: F401 (session fixture)

REQUIRED = {"max-quality": "Q8_0", "quality": "Q6_K", "balanced": "Q4_K_M", "small": "Q3_K_M", "tiny": "Q2_K",
            "compact": "IQ3_M", "minimal": "IQ2_M"}


def test_shipped_profiles_load():
    from edgeinfer.profiles import load_profiles

    profiles = load_profiles()
    for name, weights in REQUIRED.items():
        assert profiles[name].weights == weights and profiles[name].builtin
        assert profiles[name].use_when and "\n" not in profiles[name].use_when
    assert profiles["tiny"].output_type == "Q6_K"
    assert profiles["long-context"].kv_type == "q8_0"
    assert all(p.kv_type == "f16" for n, p in profiles.items() if n != "long-context")


@pytest.mark.slow
def test_every_shipped_profile_quantizes(synthetic_f16: Path, tmp_path: Path):
    from edgeinfer import read_gguf
    from edgeinfer.imatrix_compute import compute_imatrix
    from edgeinfer.profiles import load_profiles
    from edgeinfer.quant_types import IMATRIX_REQUIRED
    from edgeinfer.quantize import QUANT_TYPES, quantize_model

    # the i-quant profiles need an importance matrix; a file outside the store is given one
    imatrix = compute_imatrix(synthetic_f16, ctx=128, chunks=2, output=tmp_path / "s.imatrix.gguf", n_threads=1).path
    for name, profile in load_profiles().items():
        # balanced and long-context make the same file (the KV type applies at load): replace it.
        # Vocabulary-sized tensors the profile does not set stay F16 (copied), to keep the test fast.
        r = quantize_model(synthetic_f16, profile=profile, embedding_type="F16",
                           output_type=None if profile.output_type else "F16",
                           tag=profile.weights.lower() + (f"-{name}" if profile.output_type else ""),
                           imatrix=imatrix if profile.weights in IMATRIX_REQUIRED else "auto",
                           overwrite=True, n_threads=2)
        assert r.manifest.source["kv_type"] == profile.kv_type
        tensors = read_gguf(r.path).tensors
        types = {t.name: t.type_name for t in tensors}
        base = QUANT_TYPES[profile.weights][1]
        blk = [t.type_name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        assert blk.count(base) >= len(blk) // 2, (name, blk)
        if profile.output_type:
            assert types["output.weight"] == profile.output_type
            assert r.manifest.tag == f"{profile.weights.lower()}-{name}"
        else:
            assert r.manifest.tag == profile.weights.lower()
        assert r.manifest.source["profile"] == name


def _user_profile(home: Path, name: str, text: str) -> Path:
    d = home / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('use_when = "x"\nweights = "Q4_K_M"\nkv_typ = "f16"\n', "kv_typ"),
        ('use_when = "x"\nweights = "Q4_K_Q"\n', "weights"),
        ('use_when = "x"\nweights = "Q4_K_M"\noutput_type = "Q7"\n', "output_type"),
        ('use_when = "x"\nweights = "Q4_K_M"\nkv_type = "q5_9"\n', "kv_type"),
        ('use_when = "x"\nweights = "Q4_K_M"\n[overrides]\n"blk" = "Q3"\n', "overrides.blk"),
        ('use_when = "x"\nweights = "Q4_K_M"\n[overrides]\n"blk.(" = "Q8_0"\n', "overrides.blk.("),
        ('weights = "Q4_K_M"\n', "use_when"),
        ('use_when = "x"\nweights = 4\n', "weights"),
    ],
)
def test_broken_profile_names_file_and_key(edgeinfer_home: Path, text: str, key: str):
    from edgeinfer.profiles import ProfileError, get_profile

    path = _user_profile(edgeinfer_home, "mine", text)
    with pytest.raises(ProfileError) as e:
        get_profile("mine")
    assert str(path) in str(e.value) and repr(key) in str(e.value)
    assert "\n" not in str(e.value)


def test_user_profiles_add_and_replace(edgeinfer_home: Path, capsys: pytest.CaptureFixture[str]):
    from edgeinfer.cli import main
    from edgeinfer.profiles import get_profile, load_profiles

    _user_profile(edgeinfer_home, "balanced", 'use_when = "my balance"\nweights = "Q5_K_M"\n')
    _user_profile(edgeinfer_home, "edge", 'use_when = "first block precise"\nweights = "Q4_K_S"\n'
                  '[overrides]\n\'blk\\.0\\.\' = "Q8_0"\n')
    assert get_profile("balanced").weights == "Q5_K_M" and not get_profile("balanced").builtin
    assert get_profile("edge").overrides == ((r"blk\.0\.", "Q8_0"),)
    assert set(REQUIRED) <= set(load_profiles())
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "my balance" in out and "first block precise" in out and "long-context" in out
    with pytest.raises(Exception, match="no quant profile named 'nope'"):
        get_profile("nope")
