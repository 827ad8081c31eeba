"""Device discovery and pinning (the GPU paths are exercised with canned nvidia-smi output, and
NVML's real binding where it is installed)."""

from __future__ import annotations

import os

import pytest

from workers import devices, memory


def test_parse_nvidia_smi() -> None:
    assert devices.parse_nvidia_smi("0\n1\n\n") == ["cuda:0", "cuda:1"]
    assert devices.parse_nvidia_smi("No devices were found\n") == []


def test_forced_device_list() -> None:
    assert devices.discover({"RESIDENCY_DEVICES": "cuda:0, cuda:3"}) == ["cuda:0", "cuda:3"]


def test_child_env_pins_exactly_one_gpu_or_none() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert devices.child_env("cuda:2", base)["CUDA_VISIBLE_DEVICES"] == "2"
    assert devices.child_env("cpu", base)["CUDA_VISIBLE_DEVICES"] == ""
    assert devices.child_env("cpu", base)["PATH"] == "/bin"


def test_a_cpu_device_naming_its_cores_is_a_cpu() -> None:
    # A model on cpu:0-3 must never offload to a GPU the build can see (n_gpu_layers -> 0).
    assert devices.is_cpu("cpu") and devices.is_cpu("cpu:0-3") and devices.is_cpu("cpu:2+5")
    assert not devices.is_cpu("cuda:0") and not devices.is_cpu("cpuish")
    assert devices.default_parallel("cpu:0-3") == devices.DEFAULT_PARALLEL["cpu"]


def test_cpu_affinity() -> None:
    assert devices.cpu_affinity("cpu") is None
    assert devices.cpu_affinity("cuda:0") is None
    assert devices.cpu_affinity("cpu:0-3+6") == {0, 1, 2, 3, 6}


def test_default_threads_are_one_per_core_of_the_affinity() -> None:
    from workers.devices import default_threads

    assert default_threads({0, 1, 2, 3}) == 4
    assert default_threads({5}) == 1
    assert default_threads(set()) == 1
    assert default_threads() == len(os.sched_getaffinity(0))


def test_a_gpu_nvml_cannot_read_has_no_total_and_no_measured_footprint() -> None:
    # The real binding (the CUDA image's "cuda" extra) on a host whose NVML fails: no driver
    # library here. Each failure reads as "unknown", never as an error of the agent or the load.
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this host")
    totals = devices.device_totals(["cuda:0", "cpu"])
    assert totals == {"cuda:0": None, "cpu": devices.memory_total()}
    assert memory.measured("cuda:0") is None
    assert memory.measured("cuda:0", pid=1) is None
