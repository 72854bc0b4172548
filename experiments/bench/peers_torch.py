"""PyTorch side of ``python -m experiments.bench peers``: DDP rows on gloo.

Each node's worker (:mod:`experiments.bench.peers`) starts its ranks (one by default) with
:func:`rank_main` and drives it through a command queue, so PyTorch's rows run between
jaxcomm's rows of the same round (the load is shared). Every rank builds the same rows in
the same order; each DDP row has a gloo process group of its own, so one row's collectives
never interleave with another's.

Rows (``ROWS``): plain DDP (25 MiB buckets, PyTorch's default), DDP with the bucket size the
worker tuned on the link (:meth:`TorchRows.tune`), ``gradient_as_bucket_view=True``, and the
communication hooks ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook`` and
``batched_powerSGD_hook`` (rank, warm start and error feedback as jaxcomm's PowerSGD row),
plus the compute-only twin: the same model and optimizer on each rank's own batch, no DDP.

Two hook fixes, both applied only where the stock hook fails here and both reported with
the row (``fix``):

* ``powerSGD_hook`` issues its second all-reduce (of Q) from the callback of the first
  one's future, that is from gloo's completion thread, while the main thread goes on to the
  next bucket's P all-reduce; the ranks then issue collectives in different orders and gloo
  aborts (``gloo::EnforceNotMet``, a size mismatch) or hangs. The hook is wrapped so that it
  waits for its own future before DDP hands over the next bucket (:func:`waiting`): the
  bucket's communication no longer overlaps the rest of the backward pass.
* ``batched_powerSGD_hook`` in torch 2.14 passes a 2-D Q to ``_orthogonalize``, which
  asserts a 3-D batch of matrices (``AssertionError`` at the first compressed step): the
  row is reported with that error. torch's module is not patched.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback
from typing import Any

__all__ = ["ROWS", "TorchRow", "TorchRows", "rank_main", "waiting"]


@dataclasses.dataclass(frozen=True)
class TorchRow:
    """One PyTorch row.

    Attributes:
      name: the row's key (``--rows``).
      label: the row's name in the table.
      ddp: wrap the model in ``DistributedDataParallel`` (False: the compute-only twin).
      hook: ``None``, ``'fp16'``, ``'bf16'``, ``'powersgd'`` or ``'batched_powersgd'``.
      bucket_mb: DDP's ``bucket_cap_mb``; ``'tuned'``: the size :meth:`TorchRows.tune` chose.
      grad_view: DDP's ``gradient_as_bucket_view``.
      zero: DeepSpeed ZeRO stage (1 or 2) instead of DDP, on DeepSpeed's CPU accelerator
        with gloo (0: not DeepSpeed).
    """

    name: str
    label: str
    ddp: bool = True
    hook: str | None = None
    bucket_mb: float | str = 25.0
    grad_view: bool = False
    zero: int = 0


ROWS: tuple[TorchRow, ...] = (
    TorchRow("torch-compute", "torch compute only (no DDP)", ddp=False),
    TorchRow("torch-f32", "torch DDP f32 (25 MiB buckets)"),
    TorchRow("torch-f32-tuned", "torch DDP f32, tuned buckets", bucket_mb="tuned"),
    TorchRow("torch-f32-view", "torch DDP f32, gradient_as_bucket_view", grad_view=True),
    TorchRow("torch-fp16", "torch DDP fp16_compress_hook", hook="fp16"),
    TorchRow("torch-bf16", "torch DDP bf16_compress_hook", hook="bf16"),
    TorchRow("torch-powersgd", "torch DDP powerSGD_hook", hook="powersgd"),
    TorchRow("torch-batched-powersgd", "torch DDP batched_powerSGD_hook", hook="batched_powersgd"),
    TorchRow("torch-zero1", "DeepSpeed ZeRO-1 (CPU accelerator, gloo)", ddp=False, zero=1),
    TorchRow("torch-zero2", "DeepSpeed ZeRO-2 (CPU accelerator, gloo)", ddp=False, zero=2),
)


def waiting(hook: Any) -> Any:
    """``hook`` made to finish its bucket before returning (see the module docstring).

    Args:
      hook: a DDP communication hook ``hook(state, bucket) -> Future``.

    Returns:
      A hook that waits for ``hook``'s future, then returns it (already completed).
    """

    def wrapped(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut

    wrapped.__name__ = f"waiting_{getattr(hook, '__name__', 'hook')}"
    return wrapped


class TorchRows:
    """This rank's rows: models, optimizers, the data, the step counters.

    Args:
      rank: this rank (``node * ranks_per_node + i``).
      world: number of ranks.
      cfg: the run's settings from the worker: ``x_train`` (N, 3, px, px) f32, ``y_train``,
        ``x_test``, ``y_test``, ``order`` (training-image indices, the global batches one
        after the other), ``batch`` (global), ``lr``, ``seed``, ``powersgd_rank``,
        ``powersgd_start``.
    """

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]):
        import torch

        self.torch = torch
        self.rank, self.world, self.cfg = rank, world, cfg
        self.x_train = torch.from_numpy(cfg["x_train"])
        self.y_train = torch.from_numpy(cfg["y_train"]).long()
        self.local = cfg["batch"] // world
        self.rows: dict[str, dict[str, Any]] = {}
        self.tuned_mb: float | None = None
        self.specs = {r.name: r for r in ROWS}

    # -- building -----------------------------------------------------------------------
    def _model(self):
        import torchvision

        self.torch.manual_seed(self.cfg["seed"])
        return torchvision.models.resnet18(num_classes=10)

    def _build(self, spec: TorchRow) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = self._model()
        row: dict[str, Any] = {"steps": 0, "fix": None, "grad_view": spec.grad_view}
        if spec.zero:
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": self.local,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": self.cfg["lr"], "torch_adam": True}},
                "zero_optimization": {"stage": spec.zero},
            }
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config,
                dist_init_required=False,
            )  # fmt: skip
            row |= {"net": engine, "model": model, "engine": engine}
            return row
        if spec.ddp:
            group = dist.new_group(backend="gloo")
            bucket = self.tuned_mb if spec.bucket_mb == "tuned" else spec.bucket_mb
            if bucket is None:
                raise RuntimeError(f"{spec.name}: the bucket size has not been tuned yet")
            net = DDP(model, process_group=group, bucket_cap_mb=bucket,
                      gradient_as_bucket_view=spec.grad_view)  # fmt: skip
            row["bucket_mb"] = bucket
            if spec.hook in ("fp16", "bf16"):
                hook = getattr(default_hooks, f"{spec.hook}_compress_hook")
                net.register_comm_hook(group, hook)
            elif spec.hook in ("powersgd", "batched_powersgd"):
                state = ps.PowerSGDState(
                    process_group=group,
                    matrix_approximation_rank=self.cfg["powersgd_rank"],
                    start_powerSGD_iter=self.cfg["powersgd_start"],
                    use_error_feedback=True,
                    warm_start=True,
                    random_seed=self.cfg["seed"],
                )
                # always waited: the stock hooks break gloo's collective order (see above)
                row["fix"] = "waits for its Q all-reduce in each bucket (no overlap)"
                if spec.hook == "powersgd":
                    net.register_comm_hook(state, waiting(ps.powerSGD_hook))
                else:
                    net.register_comm_hook(state, waiting(ps.batched_powerSGD_hook))
            row["group"] = group
        else:
            net = model
        row["net"], row["model"] = net, model
        row["opt"] = self.torch.optim.Adam(net.parameters(), lr=self.cfg["lr"])
        return row

    # -- running ------------------------------------------------------------------------
    def _steps(self, row: dict[str, Any], n: int) -> None:
        import torch.nn.functional as F

        order, b, lo = self.cfg["order"], self.cfg["batch"], self.rank * self.local
        net, opt = row["net"], row.get("opt")
        net.train()
        for _ in range(n):
            start = row["steps"] * b + lo
            idx = self.torch.from_numpy(order[start : start + self.local])
            loss = F.cross_entropy(net(self.x_train[idx]), self.y_train[idx])
            if opt is None:  # a DeepSpeed engine: its backward and step
                net.backward(loss)
                net.step()
            else:
                # gradient_as_bucket_view: the gradients stay views of DDP's buckets
                opt.zero_grad(set_to_none=not row["grad_view"])
                loss.backward()
                opt.step()
            row["steps"] += 1

    def run(self, name: str, n: int) -> dict[str, Any]:
        """Runs ``n`` steps of row ``name`` (built on its first call); times them between
        two barriers over all ranks.

        Returns:
          ``{'time_s': seconds per step}``, or ``{'error': text}`` if the row failed.
        """
        import torch.distributed as dist

        spec = self.specs[name]
        out: dict[str, Any] = {}
        try:
            if name not in self.rows:
                self.rows[name] = self._build(spec)
            dist.barrier()
            t0 = time.perf_counter()
            self._steps(self.rows[name], n)
            dist.barrier()
            out["time_s"] = (time.perf_counter() - t0) / n
            out["fix"] = self.rows[name]["fix"]
            out["bucket_mb"] = self.rows[name].get("bucket_mb")
        except Exception as e:  # noqa: BLE001 - every rank reports; the worker decides
            out["error"] = f"{type(e).__name__}: {e}".strip()
            out["trace"] = traceback.format_exc(limit=6)
            self.rows.pop(name, None)
        return out

    def tune(self, candidates: list[float], steps: int) -> dict[str, Any]:
        """Picks DDP's bucket size: plain f32 DDP with each ``bucket_cap_mb`` candidate, one
        untimed step then ``steps`` timed ones (models thrown away after).

        Returns:
          ``{'bucket_mb': the fastest, 'times_s': {candidate: seconds per step}}``.
        """
        import torch.distributed as dist

        times = {}
        for mb in candidates:
            row = self._build(TorchRow(f"tune-{mb}", f"tune {mb}", bucket_mb=mb))
            self._steps(row, 1)
            dist.barrier()
            t0 = time.perf_counter()
            self._steps(row, steps)
            dist.barrier()
            times[str(mb)] = (time.perf_counter() - t0) / steps
            dist.destroy_process_group(row["group"])
        best = min(candidates, key=lambda mb: times[str(mb)])
        self.tuned_mb = best
        return {"bucket_mb": best, "times_s": times}

    def evaluate(self, name: str) -> dict[str, Any]:
        """Test accuracy of row ``name``'s model (batch norm in eval mode), on rank 0."""
        row = self.rows.get(name)
        if row is None or self.rank != 0:
            return {}
        model = row["model"]
        model.eval()
        with self.torch.no_grad():
            pred = model(self.torch.from_numpy(self.cfg["x_test"])).argmax(-1).numpy()
        model.train()
        return {"accuracy": float((pred == self.cfg["y_test"]).mean())}

    def reseed(self, seed: int, order: Any) -> dict[str, Any]:
        """Rows built from now on start from ``seed`` and see the batches of ``order``."""
        self.cfg = {**self.cfg, "seed": seed, "order": order}
        return {}

    def drop(self, name: str) -> dict[str, Any]:
        """Frees row ``name``'s model, optimizer and process group (the training budget
        trains each row once per seed)."""
        import torch.distributed as dist

        row = self.rows.pop(name, None)
        if row is not None and row.get("group") is not None:
            dist.destroy_process_group(row["group"])
        return {}

    def info(self) -> dict[str, Any]:
        """The model's parameter count and f32 gradient bytes."""
        n = sum(p.numel() for p in self._model().parameters())
        return {"params": n, "grad_bytes": 4 * n}


def rank_main(rank: int, world: int, addr: str, port: int, cfg: dict, cmds, results) -> None:
    """A PyTorch rank: joins gloo, then serves the worker's commands until ``stop``.

    Commands (tuples): ``('info',)``, ``('tune', candidates, steps)``, ``('run', row, n)``,
    ``('eval', row)``, ``('drop', row)``, ``('reseed', seed, order)``, ``('stop',)``. Each
    answer is put on ``results`` as ``(rank, dict)``; a rank that cannot go on answers
    ``(rank, {'fatal': traceback})`` and exits.
    """
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        # DeepSpeed's rows: its CPU accelerator, this rank's place (read when it starts)
        dpn = cfg["ranks_per_node"]
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank % dpn), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_SIZE=str(dpn))  # fmt: skip
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=900),
        )  # fmt: skip
        rows = TorchRows(rank, world, cfg)
        while True:
            cmd = cmds.get()
            if cmd[0] == "stop":
                break
            handler = {"info": rows.info, "tune": rows.tune, "run": rows.run,
                       "eval": rows.evaluate, "drop": rows.drop,
                       "reseed": rows.reseed}[cmd[0]]  # fmt: skip
            results.put((rank, handler(*cmd[1:])))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the worker prints it and stops the run
        results.put((rank, {"fatal": traceback.format_exc()}))
