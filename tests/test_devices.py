"""Placement without RPC workers: the build's backends, LoadOptions' placement fields and flags,
llama.cpp's layer arithmetic, a CPU-only build's answers, and the GPU offload path where a GPU
backend exists (skipped, saying why, where none does)."""

from __future__ import annotations

import ctypes
import json

import pytest
from greedy_compare import assert_same_or_near_tie

import edgeinfer
from edgeinfer import devices
from edgeinfer.cli import main
from edgeinfer.devices import DeviceInfo, PlacementError, placement, plan_placement, registry
from edgeinfer.engine.core.options import LoadOptions
from edgeinfer.fit import estimate_memory, model_sizes

GPU_BUILD_HINT = ('no GPU backend in this build of llama-cpp-python (see `edgeinfer doctor`); build it with '
                  'CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on, -DGGML_VULKAN=on) to run the offload path')


def _has_local_gpu() -> bool:
    return bool(devices.local_gpu_devices())


# -- options and flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"n_gpu_layers": -1}, "n_gpu_layers must be in [0,"),
    ({"n_gpu_layers": "some"}, "n_gpu_layers must be a number of layers, 'all' or 'auto'"),
    ({"n_gpu_layers": True}, "n_gpu_layers must be a number of layers"),
    ({"draft_gpu_layers": "x"}, "draft_gpu_layers must be a number of layers"),
    ({"rpc": "127.0.0.1:50052"}, "rpc must be a tuple"),
    ({"rpc": ("127.0.0.1",)}, "an RPC worker is 'host:port'"),
    ({"rpc": ("127.0.0.1:0",)}, "the port must be 1..65535"),
    ({"rpc": ("[::1]:50052",)}, "an RPC worker is 'host:port' (IPv4 or a host name)"),
    ({"rpc": ("a:1", "a:1")}, "RPC worker a:1 is named twice"),
    ({"rpc": tuple(f"h:{i}" for i in range(1, 18))}, "at most 16 RPC workers"),
    ({"tensor_split": (1, float("nan"))}, "must be a finite number"),
    ({"tensor_split": (1, -1)}, "tensor_split shares must be >= 0"),
    ({"tensor_split": (0, 0)}, "at least one share above 0"),
    ({"tensor_split": (1, 1), "n_gpu_layers": 4}, "give a number of GPU layers or a tensor split, not both"),
])
def test_load_options_refuse_bad_placement(fields, message):
    with pytest.raises(edgeinfer.InvalidOptionError) as e:
        LoadOptions(**fields).validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_options_accept_placement_and_draft_follows_the_target():
    o = LoadOptions(n_gpu_layers="all", rpc=("10.0.0.2:50052", "gpu-box:1"), tensor_split=(0, 2, 1), n_threads=1).validate()
    d = o.draft_options(n_ctx=512)
    assert (d.n_gpu_layers, d.rpc, d.tensor_split, d.n_ctx, d.n_threads) == ("all", o.rpc, (0, 2, 1), 512, 1)
    d = LoadOptions(n_gpu_layers=12, draft_gpu_layers=0, rpc=("h:1",)).validate().draft_options()
    assert (d.n_gpu_layers, d.rpc, d.tensor_split) == (0, ("h:1",), ())
    assert LoadOptions().n_gpu_layers == "auto"


@pytest.mark.parametrize("argv, message", [
    (["run", "--gpu-layers", "-3", "Hi"], "argument --gpu-layers: must be between 0 and"),
    (["run", "--gpu-layers", "most", "Hi"], "argument --gpu-layers: expected a number of layers, 'all' or 'auto'"),
    (["bench", "--rpc", "nohost"], "argument --rpc: an RPC worker is 'host:port'"),
    (["eval", "--rpc", "a:1,a:1"], "argument --rpc: RPC worker a:1 is named twice"),
    (["fit", "--tensor-split", "1,x"], "argument --tensor-split: expected shares like 1,1,1"),
    (["fit", "--tensor-split", "0,0"], "argument --tensor-split: shares must be numbers >= 0, at least one above 0"),
    (["serve", "--tensor-split", "1,-1"], "argument --tensor-split: shares must be numbers >= 0"),
    (["chat", "--gpu-layers", "1.5"], "argument --gpu-layers: expected a number of layers"),
    (["rpc-worker", "--mem", "0"], "argument --mem: must be more than 0 GiB"),
    (["rpc-worker", "--port", "70000"], "argument --port: must be between 1 and 65535"),
    (["doctor", "--rpc", "h:99999"], "argument --rpc: RPC worker 'h:99999': the port must be 1..65535"),
])
def test_placement_flags_refuse_bad_values_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgeinfer: error: ") and message in err and "\n" not in err, err


# -- llama.cpp's arithmetic ---------------------------------------------------------------------------------


def test_layer_assignment_follows_llama_cpp():
    # llama-model.cpp load_tensors: the first (n_layer + 1 - n_gpu) layers on the host, the rest by
    # upper_bound over the normalised cumulative split; the output layer (index n_layer) is last.
    owner = placement._assign_layers(30, 21, [1.0, 1.0])
    assert owner.count(-1) == 10 and owner.count(0) == 11 and owner.count(1) == 10 and owner[-1] == 1
    assert placement._assign_layers(30, 0, [1.0, 1.0]) == [-1] * 31
    assert placement._assign_layers(30, 99, [0.0, 1.0]) == [1] * 31
    assert placement._assign_layers(27, 28, [3.0, 1.0]).count(0) == 21


def _devices(*free_mb: float) -> list[DeviceInfo]:
    return [DeviceInfo(f"GPU{i}", "test device", "gpu", "TEST", int(mb * 1e6), int(mb * 1e6)) for i, mb in enumerate(free_mb)]


def test_plan_auto_puts_on_devices_what_fits(default_model_path):
    from edgeinfer.gguf_file import read_gguf

    info = read_gguf(default_model_path)
    sizes = model_sizes(info, 2048)
    roomy = plan_placement(sizes, _devices(10_000), host_free=10**10)
    assert roomy.n_gpu_layers == 31 and roomy.host.n_layers == 0 and roomy.fits
    # 450 MB, 256 MiB of it kept free; the output layer (logits, a copy of the tied embedding) goes first
    small = plan_placement(sizes, _devices(450), host_free=10**10)
    assert 0 < small.n_gpu_layers < 31 and small.fits
    assert small.devices[0].total + placement._DEVICE_MARGIN <= small.devices[0].memory_free
    nothing = plan_placement(sizes, _devices(100), host_free=10**10)
    assert nothing.n_gpu_layers == 0 and nothing.summary() == "CPU"
    # The parts add up to the whole model: every weight is somewhere (a tied output is copied to
    # its device: SmolLM2's is), the KV cache too.
    whole = estimate_memory(info, 2048)
    tied = sizes.tied_output
    assert tied > 0
    for plan in (roomy, small, nothing):
        assert sum(p.weights for p in plan.parts) == whole.weights + (tied if plan.n_gpu_layers else 0)
        assert sum(p.kv_cache for p in plan.parts) == pytest.approx(whole.kv_cache, rel=1e-6)


def test_plan_refuses_an_explicit_placement_a_device_cannot_hold(default_model_path):
    from edgeinfer.gguf_file import read_gguf

    sizes = model_sizes(read_gguf(default_model_path))
    with pytest.raises(PlacementError, match=r"GPU0 \(test device\) would hold .* but reports 50.0 MB free"):
        plan_placement(sizes, _devices(50), n_gpu_layers="all", host_free=10**10)
    plan = plan_placement(sizes, _devices(50), n_gpu_layers="all", host_free=10**10, strict=False)
    assert plan.fits is False
    with pytest.raises(edgeinfer.InvalidOptionError, match=r"--tensor-split has 2 values for 3 parts \(host, GPU0, GPU1\)"):
        plan_placement(sizes, _devices(1e4, 1e4), tensor_split=(1, 1))
    with pytest.raises(edgeinfer.InvalidOptionError, match="contradict"):
        plan_placement(sizes, _devices(1e4), n_gpu_layers="all", tensor_split=(1, 1))
    # llama.cpp is given the planned layer count of each device as its split: its layers are the plan's
    plan = plan_placement(sizes, _devices(1e4, 1e4), tensor_split=(1, 2, 3))
    assert plan.tensor_split == tuple(float(p.n_layers) for p in plan.devices) and sum(plan.tensor_split) == plan.n_gpu_layers


# -- this build ------------------------------------------------------------------------------------------------


def test_placement_fields_of_a_cpu_load(default_model_path):
    from edgeinfer.engine.llama.runtime import require_fields, set_fields
    from edgeinfer.llama_backend import backend

    ll = backend()
    require_fields(ll.llama_model_params, "devices", "n_gpu_layers", "tensor_split", "load_mode", "progress_callback")
    fields = LoadOptions(n_gpu_layers=0).validate().placement_fields(ll, default_model_path)
    assert set(fields) == {"n_gpu_layers", "devices", "tensor_split"}
    params = set_fields(ll.llama_model_default_params(), **fields)
    del fields
    assert params.n_gpu_layers == 0
    listed = ctypes.cast(params.devices, ctypes.POINTER(ctypes.c_void_p))
    assert params.devices and listed[0] is None  # an explicit, empty device list: not "every device"
    assert len(params._objects) >= 2  # the struct keeps its device list and split alive


@pytest.mark.skipif("_has_local_gpu()", reason="this build has a GPU backend: the CPU-only answers do not apply")
def test_cpu_only_build_says_so_and_runs_on_the_cpu(default_model_path, capsys):
    assert not devices.build_info().local_gpus
    with edgeinfer.load(default_model_path, n_threads=1) as engine:  # auto
        assert devices.last_placement(default_model_path).n_gpu_layers == 0
        assert engine.backend == "CPU"
    code = main(["run", "--gpu-layers", "10", "-n", "4", "--temperature", "0", "--threads", "1", "Hi"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    assert ("edgeinfer: warning: this llama.cpp build has no GPU backend: --gpu-layers 10 has nothing to offload "
            "to, so every layer runs on the CPU") in captured.err
    assert devices.last_placement(default_model_path).summary() == "CPU"
    assert main(["fit", "--gpu-layers", "all"]) == 0
    assert "no GPU backend" in capsys.readouterr().out


def test_doctor_says_what_this_build_has(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    info = devices.build_info()
    assert "backend CPU" in out and "CPU features" in out
    if info.local_gpus:
        assert "GPU offload       yes" in out
    else:
        assert "GPU offload       no GPU backend in this build" in out
        assert 'CMAKE_ARGS="-DGGML_RPC=ON -DGGML_CUDA=on"' in out and "--force-reinstall --no-cache-dir" in out
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rpc"] == info.rpc and data["backends"] and data["cpu_features"] == info.cpu_features


def test_a_build_without_rpc_says_how_to_rebuild(monkeypatch, capsys, default_model_path):
    monkeypatch.setattr(registry, "has_rpc", lambda: False)
    for argv in (["rpc-worker"], ["run", "--rpc", "127.0.0.1:50052", "-n", "1", "Hi"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("edgeinfer: error: this llama-cpp-python was built without llama.cpp's RPC backend")
        assert 'rebuild it with: CMAKE_ARGS="-DGGML_RPC=ON" ' in err and "-m pip install --force-reinstall --no-cache-dir" in err
        assert "llama-cpp-python==0.3.36" in err and "\n" not in err
    assert main(["doctor"]) == 0
    assert "RPC               no: rebuild with CMAKE_ARGS" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif("not _has_local_gpu()", reason=GPU_BUILD_HINT)
def test_gpu_offload_puts_layers_on_the_device_and_keeps_greedy_output(default_model_path):
    from edgeinfer.llama_backend import log_capture

    opts = edgeinfer.GenerateOptions(max_tokens=32, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    with edgeinfer.load(default_model_path, n_gpu_layers=0) as cpu:
        prompt = cpu.tokenize("The three primary colours are", add_special=True)
        reference = cpu.generate(prompt, opts).result().tokens
    said: list[str] = []
    with log_capture(lambda _level, text: said.append(text)), \
            edgeinfer.load(default_model_path, n_gpu_layers="all") as gpu:
        placement = devices.last_placement(default_model_path)
        tokens = gpu.generate(prompt, opts).result().tokens
        assert_same_or_near_tie(gpu, prompt, reference, tokens)
    assert placement.host.n_layers == 0 and placement.devices[0].n_layers == placement.n_layer + 1
    assert f"offloaded {placement.n_layer + 1}/{placement.n_layer + 1} layers to GPU" in "".join(said)
    with edgeinfer.load(default_model_path) as _auto:  # auto: everything fits a real GPU
        assert devices.last_placement(default_model_path).n_gpu_layers == placement.n_layer + 1


def test_a_draft_model_follows_the_targets_placement_unless_told(default_model_path, capsys):
    """draft=, self= and auto= load their draft model with the target's placement; --draft-gpu-layers
    (LoadOptions.draft_gpu_layers) places it apart (and drops the target's split)."""
    target = LoadOptions(n_threads=1, n_gpu_layers=5, tensor_split=(1.0, 2.0))
    same = target.draft_options(n_ctx=512)
    assert (same.n_gpu_layers, same.tensor_split, same.n_ctx, same.n_threads) == (5, (1.0, 2.0), 512, 1)
    apart = LoadOptions(n_threads=1, n_gpu_layers=5, tensor_split=(1.0, 2.0), draft_gpu_layers=0).draft_options()
    assert (apart.n_gpu_layers, apart.tensor_split) == (0, ())
    code = main(["run", "--draft-gpu-layers", "0", "--speculate", f"draft={default_model_path}", "-n", "4",
                 "--temperature", "0", "--threads", "1", "--json", "Hi"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["stats"]["speculation"]["method"] == "draft"
