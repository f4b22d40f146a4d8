"""Every Keras and GAN training test in ONE 4-rank job: TensorFlow's start-up costs
seconds per rank, a digits run well under that.

Usage: mpiexec -n 4 python tests/mpi_scripts/keras_job.py OUT_DIR SPEC.json

1. Equivalences, two at once on two pairs of ranks:
   ranks 0-1  nbdist's allreduce path (equivalence_common.allreduce_steps with a
              KerasBackend: several buckets, sample shares, the flat Keras optimiser), equal
              and unequal batches; rank 0
              writes OUT_DIR/allreduce-<layout>.safetensors and, from plain Keras on the
              concatenated batches, OUT_DIR/allreduce-<layout>-reference.safetensors;
   ranks 2-3  nbdist.train with Downpour, one master and one worker, for each master
              optimiser in SPEC["downpour"]; the worker's rank then writes plain Keras SGD
              over the same batches, OUT_DIR/<name>-reference.safetensors.
2. SPEC["runs"] (argv lists after `train`) on all ranks through nbdist.cli.main, as
   train_many.py does (same markers).
3. Rank 0, for each Keras GAN run in SPEC["gans"] ({run directory: model file}): samples
   of the untrained generator and of the trained one (its final weights loaded as the
   README says), for the same noise: OUT_DIR/<run name>-samples.npz.

No run here uses PyTorch, so the job never imports it (notebooks/03_gan.ipynb, executed
by test_notebooks.py, trains the PyTorch GAN under the same conditions and checks it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import equivalence_common as common
import keras
import keras_common
import numpy as np
from mpi4py import MPI
from rank_main import run_or_abort
from safetensors.numpy import load_file, save_file
from train_many import run_all

import nbdist
from nbdist.backends import configure_frameworks
from nbdist.backends.keras import KerasBackend
from nbdist.data.sharding import ShardPlan
from nbdist.specs import parse_spec
from nbdist.train.definition import load_model_file

STEPS = 12
DOWNPOUR = dict(epochs=3, batch_size=16, seed=3)
GAN_SAMPLES, GAN_NOISE_SEED = 500, 99


def allreduce(comm: MPI.Intracomm, out: Path) -> None:
    x, y = common.make_arrays()
    for layout in ("equal", "unequal"):
        backend = KerasBackend(keras_common.initial_model(), sample=x[:2])
        common.allreduce_steps(comm, backend, STEPS, layout == "unequal")
        if comm.Get_rank() == 0:
            save_file(backend.named_arrays(), str(out / f"allreduce-{layout}.safetensors"))
            batches = common.global_batches(STEPS, comm.Get_size(), layout == "unequal")
            reference = keras_common.plain_keras(keras_common.initial_model(), batches, x, y, common.MOMENTUM)
            save_file(reference, str(out / f"allreduce-{layout}-reference.safetensors"))
            print(f"OK allreduce-{layout}", flush=True)


def downpour(comm: MPI.Intracomm, out: Path, runs: dict[str, str]) -> None:
    data = common.make_data()
    plan = ShardPlan(data.n_train, 1, DOWNPOUR["batch_size"], DOWNPOUR["seed"])
    batches = [b for epoch in range(DOWNPOUR["epochs"]) for b in plan.epoch(epoch, 0)]
    for name, master_optimizer in runs.items():
        nbdist.train(
            keras_common.build_model,
            data=common.make_data,
            comm=comm,
            topology="master-worker",
            algorithm="downpour",
            sync_every=1,
            master_optimizer=master_optimizer,
            runs_dir=str(out / "runs"),
            run_name=name,
            quiet=True,
            **DOWNPOUR,
        )
        if comm.Get_rank() == 1:
            momentum = float(parse_spec(master_optimizer).kwargs.get("momentum", 0.0))
            model = keras_common.initial_model(DOWNPOUR["seed"])
            reference = keras_common.plain_keras(model, batches, data.x_train, data.y_train, momentum)
            save_file(reference, str(out / f"{name}-reference.safetensors"))
            print(f"OK {name}", flush=True)


def _sample(generator: keras.Model, z: np.ndarray) -> np.ndarray:
    return np.asarray(generator(z, training=False))


def gan_samples(run_dir: Path, model_file: str, out: Path) -> None:
    configure_frameworks(1, 0)  # the run's default seed: its untrained generator
    definition = load_model_file(model_file)
    configure_frameworks(1, 0)
    gan = definition.make_gan(1)
    z = np.random.default_rng(GAN_NOISE_SEED).standard_normal((GAN_SAMPLES, gan.latent_dim), dtype=np.float32)
    before = _sample(gan.generator, z)
    # The README's recipe for a Keras GAN's final/model.safetensors.
    weights = load_file(str(run_dir / "final" / "model.safetensors"))
    gan.generator.set_weights([weights[k] for k in sorted(weights) if k.startswith("generator/")])
    np.savez(out / f"{run_dir.name}-samples.npz", before=before, after=_sample(gan.generator, z))
    print(f"OK samples {run_dir.name}", flush=True)


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    world = MPI.COMM_WORLD
    assert world.Get_size() == 4, "run with mpiexec -n 4"
    configure_frameworks(1, 0)
    pair = world.Split(world.Get_rank() // 2, world.Get_rank())
    if world.Get_rank() < 2:
        allreduce(pair, out)
    else:
        downpour(pair, out, spec["downpour"])
    pair.Free()
    world.Barrier()

    runs = out / "runs.json"
    if world.Get_rank() == 0:
        runs.write_text(json.dumps(spec["runs"]))
    world.Barrier()
    run_all(str(runs))

    if world.Get_rank() == 0:
        for run_dir, model_file in spec["gans"].items():
            gan_samples(Path(run_dir), model_file, out)
    world.Barrier()


if __name__ == "__main__":
    run_or_abort(main)
