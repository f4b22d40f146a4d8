"""The tutorials in notebooks/, executed top to bottom in a real kernel, as a reader would,
each starting its own local cluster of MPI engines; and binder's set-up for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
from nbclient import NotebookClient  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]


def _outputs_text(nb) -> str:
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


def test_the_tutorials_are_committed_without_outputs():
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: a cell has outputs"


# The jet tutorial's sample is the session's (conftest.jet_sample, the same settings), but
# for these files, which its engines make again: generation on a cluster is tested too.
JETS_REMADE_ON_THE_CLUSTER = ("train_005.h5", "val_001.h5")


def _hand_over_the_jet_sample(request, tmp_path: Path) -> Path:
    import shutil

    sample = request.getfixturevalue("jet_sample")
    shutil.copytree(sample.directory, tmp_path / "data" / "jets")
    for name in JETS_REMADE_ON_THE_CLUSTER:
        (tmp_path / "data" / "jets" / name).unlink()
    return sample.directory


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_executes_top_to_bottom(path, tmp_path, request):
    if path.stem == "02_jet_tagging":
        made_by_mpiexec = _hand_over_the_jet_sample(request, tmp_path)
    nb = nbformat.read(path, as_version=4)
    # Run where a reader would have their own working directory: runs/ goes there.
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # a failing cell, including the notebook's own final checks, raises here
    text = _outputs_text(nb)
    assert "Traceback" not in text
    if path.stem == "01_quickstart":
        assert "all four trainings reached at least 90% validation accuracy" in text
        assert len(list((tmp_path / "runs").glob("*/final/model.safetensors"))) == 7  # 4 + 3 momentum runs
        assert "cluster stopped" in text  # the notebook leaves no engines behind
    if path.stem == "02_jet_tagging":
        assert "both CNNs reached AUC >= 0.85 on the held-out jets" in text
        assert "made 2 files" in text and "reused 6 already made" in text
        assert "cluster stopped" in text
        assert len(list((tmp_path / "runs").glob("*/final/model.safetensors"))) == 2
        h5py = pytest.importorskip("h5py")
        import numpy as np

        for name in JETS_REMADE_ON_THE_CLUSTER:  # the engines made what two mpiexec ranks made
            with h5py.File(tmp_path / "data" / "jets" / name) as remade, h5py.File(made_by_mpiexec / name) as first:
                assert set(remade) == set(first)
                for key in first:
                    np.testing.assert_array_equal(remade[key][:], first[key][:], err_msg=f"{name}: {key}")
    if path.stem == "04_model_distribution":
        assert "all model-distribution runs reached at least 90% validation accuracy" in text
        runs = {json.loads(f.read_text())["worker_parallel"] for f in (tmp_path / "runs").glob("*/options.json")}
        assert runs == {"pipeline", "allreduce"}, runs  # the pipeline ran as stages, the rest as replicas
        assert "cluster stopped" in text
    if path.stem == "05_hpo_schedulers":
        assert "ASHA: every promoted trial went on from its checkpoint, no epoch trained twice" in text
        assert "PBT: 3 exploits, each copied the weights and optimiser state bit for bit" in text
        assert len(list((tmp_path / "runs").glob("*-trial*-fold0/checkpoints/exploit-0001"))) == 1
        assert "cluster stopped" in text
    if path.stem == "03_gan":
        assert "the trained generator's digits are closer to the real ones" in text
        runs = list((tmp_path / "runs").glob("*-master-worker-easgd"))
        assert len(runs) == 1 and (runs[0] / "final" / "model.safetensors").exists()
        options = json.loads((runs[0] / "options.json").read_text())
        assert options["gan"] and options["workers"] == 3
        assert "cluster stopped" in text


def test_binder_postbuild_loads_the_extension_in_new_kernels(tmp_path):
    # repo2docker runs postBuild from the repository root, in the environment it built.
    env = dict(
        os.environ,
        IPYTHONDIR=str(tmp_path / "ipython"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    done = subprocess.run(["bash", "binder/postBuild"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("print(sorted(get_ipython().extension_manager.loaded))\n%distnn cluster status")
        ]
    )
    client = NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # a new kernel, as binder starts one, reading the profile postBuild wrote
    text = _outputs_text(nb)
    assert "'nbdist'" in text and "nbdist cluster: not running" in text


def test_binder_installs_the_cpu_build_of_torch_pinned_for_the_project():
    requirements = (ROOT / "binder" / "requirements.txt").read_text()
    assert "-r ../requirements/cpu.txt" in requirements
    assert "download.pytorch.org/whl/cpu" in requirements
