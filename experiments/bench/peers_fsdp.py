"""PyTorch side of ``python -m experiments.bench peers --workload gpt``: FSDP2 rows on gloo.

Each node's worker (:mod:`experiments.bench.peers_lm`) starts ``devices_per_node`` ranks
with :func:`rank_main` (one per device, one thread each) and drives them through a command
queue, as :mod:`experiments.bench.peers_torch` does for DDP. The ranks build a 2-D
``DeviceMesh`` ``(nodes, devices_per_node)`` named ``('replicate', 'shard')``: rank
``node * devices_per_node + i``, so a ``'shard'`` group is one node's ranks and a
``'replicate'`` group spans the nodes.

The model (:class:`TorchGPT`) is ``jaxcomm.models.gpt``'s, layer for layer (the same
parameter count, GELU's tanh form, LayerNorm epsilon 1e-6, the head tied to the token
embedding), loaded from the JAX model's initial values (the worker converts them:
``peers_lm.torch_state``), so both frameworks start from the same weights.

Rows (``ROWS``):

* ``torch-compute``: the compute-only twin, the model unsharded on every rank, its own
  batch, no collective.
* ``torch-hsdp-f32``: FSDP2 HSDP, ``fully_shard(block, mesh=mesh)`` per block and on the
  model, over the 2-D mesh: gradients reduce-scattered over ``'shard'`` (inside a node),
  then all-reduced over ``'replicate'`` (across the link), in f32.
* ``torch-hsdp-bf16``: the same with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
  (both reductions in bf16).
* ``torch-fsdp-int8``: FSDP2 over the node only (``mesh['shard']``), and
  ``set_all_reduce_hook`` on every FSDP module doing the cross-node sync: blockwise int8
  (an f32 absmax scale per 256 values, round to nearest, error feedback per rank and
  module) all-gathered over the ``'replicate'`` group, dequantized and averaged in f32
  (:class:`Int8AllReduceHook`). gloo reduces int8 but not with a scale per block, and a sum
  of int8 codes overflows; gathering the codes sends the same bytes as a 2-rank ring
  all-reduce of them.

Every FSDP row's hook records the tensor it was given (HSDP: the all-reduce's output,
in the reduce dtype; 1-D FSDP: the reduce-scatter's output), so the bytes each rank puts
on the cross-node collective per step are counted, not assumed (:meth:`FSDPRows.info`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback
from typing import Any

__all__ = ["ROWS", "FSDPRows", "Int8AllReduceHook", "TorchGPT", "TorchRow", "rank_main"]


@dataclasses.dataclass(frozen=True)
class TorchRow:
    """One PyTorch row: ``name`` (``--rows`` key), ``label`` (table), ``kind``:
    ``'compute'``, ``'hsdp'`` or ``'fsdp-hook'``; ``reduce_dtype``: ``'float32'`` or
    ``'bfloat16'``."""

    name: str
    label: str
    kind: str
    reduce_dtype: str = "float32"


ROWS: tuple[TorchRow, ...] = (
    TorchRow("torch-compute", "torch compute only (unsharded, no collective)", "compute"),
    TorchRow("torch-hsdp-f32", "torch FSDP2 HSDP (2-D mesh), f32 reduce", "hsdp"),
    TorchRow("torch-hsdp-bf16", "torch FSDP2 HSDP, reduce_dtype=bf16", "hsdp", "bfloat16"),
    TorchRow("torch-fsdp-int8", "torch FSDP2 in-node + int8 all-reduce hook (EF)", "fsdp-hook"),
)


def _torch_gpt_class():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, hidden: int):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d, eps=1e-6)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d, eps=1e-6)
            self.fc = nn.Linear(d, hidden)
            self.out = nn.Linear(hidden, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)

            def heads(z):
                return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

            y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        """``jaxcomm.models.gpt`` in PyTorch (tied head)."""

        def __init__(self, layers: int, d: int, heads: int, context: int, vocab: int,
                     mlp_ratio: int):  # fmt: skip
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(context, d)
            self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio * d) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d, eps=1e-6)

        def forward(self, tokens):
            t = tokens.shape[-1]
            x = self.wte(tokens) + self.wpe(torch.arange(t))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.T

    return GPT


def TorchGPT(config: dict[str, int]) -> Any:  # noqa: N802 - a class, built lazily
    """A PyTorch GPT of ``config`` (``layers``, ``d_model``, ``heads``, ``context``,
    ``vocab``, ``mlp_ratio``), weights uninitialised until a state dict is loaded."""
    c = config
    return _torch_gpt_class()(c["layers"], c["d_model"], c["heads"], c["context"], c["vocab"],
                              c["mlp_ratio"])  # fmt: skip


class Int8AllReduceHook:
    """FSDP2's all-reduce hook: the cross-node sync of a reduce-scattered gradient in int8.

    1. add this rank's error-feedback residual of this module's gradient (zero at first);
    2. per block of ``block`` values an f32 scale ``absmax / 127``; codes
       ``round(g / scale)`` as int8; the new residual is ``g - codes * scale``;
    3. all-gather the codes and the scales over the ``'replicate'`` group (gloo);
    4. dequantize every rank's codes and average them in f32, in place.

    Residuals are kept per call position in the backward pass (one per FSDP module, the
    same order every step), as ``jaxcomm.compression.int8(error_feedback=True)`` keeps one
    per device and leaf. ``sent_bytes`` counts the payload this rank sends per call.

    Args:
      group: the ``'replicate'`` process group.
      block: values per scale (jaxcomm's int8 default: 256).
    """

    def __init__(self, group: Any, block: int = 256):
        self.group, self.block = group, block
        self.residuals: list[Any] = []
        self.calls = 0
        self.sent_bytes = 0

    def new_step(self) -> None:
        self.calls = 0

    def __call__(self, grad: Any) -> None:
        import torch
        import torch.distributed as dist

        i = self.calls
        self.calls += 1
        if i == len(self.residuals):
            self.residuals.append(torch.zeros_like(grad, dtype=torch.float32))
        n = grad.numel()
        pad = (-n) % self.block
        g = grad.float() + self.residuals[i]
        blocks = torch.nn.functional.pad(g, (0, pad)).view(-1, self.block)
        scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
        codes = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
        self.residuals[i] = (blocks - codes.float() * scale).view(-1)[:n]
        world = dist.get_world_size(self.group)
        all_codes = [torch.empty_like(codes) for _ in range(world)]
        all_scales = [torch.empty_like(scale) for _ in range(world)]
        dist.all_gather(all_codes, codes, group=self.group)
        dist.all_gather(all_scales, scale, group=self.group)
        total = sum(c.float() * s for c, s in zip(all_codes, all_scales, strict=True))
        grad.copy_((total / world).view(-1)[:n].to(grad.dtype))
        self.sent_bytes += codes.numel() + 4 * scale.numel()


class _CountingHook:
    """An all-reduce hook that changes nothing and counts the bytes of what it was given."""

    def __init__(self):
        self.sent_bytes = 0

    def new_step(self) -> None:
        pass

    def __call__(self, grad: Any) -> None:
        self.sent_bytes += grad.numel() * grad.element_size()


class FSDPRows:
    """This rank's rows: models, optimizers, the data, the step counters.

    Args:
      rank, world: this rank and the number of ranks (``nodes x ranks_per_node``).
      cfg: the worker's settings: ``gpt`` (the config dict), ``inits`` (seed -> the JAX
        model's initial values as PyTorch state-dict arrays), ``batch`` (global), ``context``,
        ``lr``, ``betas``, ``weight_decay``, ``seed``, ``ranks_per_node``, ``eval``
        (``(E, context + 1)`` held-out windows).
    """

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]):
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from experiments.text import TextWindows, load_corpus

        self.torch = torch
        self.rank, self.world, self.cfg = rank, world, cfg
        dpn = cfg["ranks_per_node"]
        self.mesh = init_device_mesh("cpu", (world // dpn, dpn),
                                     mesh_dim_names=("replicate", "shard"))  # fmt: skip
        self.windows = TextWindows(load_corpus().train, None, global_batch=cfg["batch"],
                                   context=cfg["context"], seed=cfg["seed"])  # fmt: skip
        self.local = cfg["batch"] // world
        self.rows: dict[str, dict[str, Any]] = {}
        self.specs = {r.name: r for r in ROWS}

    def _model(self):
        torch = self.torch
        model = TorchGPT(self.cfg["gpt"])
        init = self.cfg["inits"][self.cfg["seed"]]
        state = {k: torch.from_numpy(v.copy()) for k, v in init.items()}
        model.load_state_dict(state, strict=True)
        return model

    def _build(self, spec: TorchRow) -> dict[str, Any]:
        torch = self.torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = self._model()
        row: dict[str, Any] = {"steps": 0, "hooks": []}
        if spec.kind != "compute":
            mesh = self.mesh if spec.kind == "hsdp" else self.mesh["shard"]
            mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, spec.reduce_dtype))
            modules = [*model.blocks, model]
            for m in modules:
                fully_shard(m, mesh=mesh, mp_policy=mp)
            for m in modules:
                hook = (
                    _CountingHook()
                    if spec.kind == "hsdp"
                    else Int8AllReduceHook(self.mesh.get_group("replicate"))
                )
                m.set_all_reduce_hook(hook)
                row["hooks"].append(hook)
        row["model"] = model
        betas = tuple(self.cfg["betas"])
        row["opt"] = torch.optim.AdamW(model.parameters(), lr=self.cfg["lr"], betas=betas,
                                       eps=1e-8, weight_decay=self.cfg["weight_decay"])  # fmt: skip
        return row

    def _loss(self, model, tokens):
        import torch.nn.functional as F

        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def _steps(self, row: dict[str, Any], n: int) -> None:
        torch = self.torch
        model, opt, lo = row["model"], row["opt"], self.rank * self.local
        model.train()
        for _ in range(n):
            tokens = self.windows.host_batch(row["steps"])["tokens"][lo : lo + self.local]
            for h in row["hooks"]:
                h.new_step()
            loss = self._loss(model, torch.from_numpy(tokens).long())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            row["steps"] += 1

    def run(self, name: str, n: int) -> dict[str, Any]:
        """Runs ``n`` steps of row ``name`` (built on its first call), timed between two
        barriers over all ranks.

        Returns:
          ``{'time_s': seconds per step, 'hook_bytes': bytes this rank's hooks were given
          or sent per step}``, or ``{'error': text}``.
        """
        import torch.distributed as dist

        out: dict[str, Any] = {}
        try:
            if name not in self.rows:
                self.rows[name] = self._build(self.specs[name])
            row = self.rows[name]
            before = sum(h.sent_bytes for h in row["hooks"])
            dist.barrier()
            t0 = time.perf_counter()
            self._steps(row, n)
            dist.barrier()
            out["time_s"] = (time.perf_counter() - t0) / n
            out["hook_bytes"] = (sum(h.sent_bytes for h in row["hooks"]) - before) / n
        except Exception as e:  # noqa: BLE001 - every rank reports; the worker decides
            out["error"] = f"{type(e).__name__}: {e}".strip()
            out["trace"] = traceback.format_exc(limit=8)
            self.rows.pop(name, None)
        return out

    def evaluate(self, name: str) -> dict[str, Any]:
        """Held-out loss (nats per byte) of row ``name``'s model on ``cfg['eval']``; every
        rank runs it (an FSDP forward gathers the params), rank 0's answer is kept."""
        torch = self.torch
        row = self.rows.get(name)
        if row is None:
            return {}
        model = row["model"]
        model.eval()
        with torch.no_grad():
            tokens = torch.from_numpy(self.cfg["eval"]).long()
            losses = [float(self._loss(model, tokens[i : i + 8])) for i in range(0, len(tokens), 8)]
        model.train()
        return {"loss": sum(losses) / len(losses)}

    def reseed(self, seed: int) -> dict[str, Any]:
        """Drops every row; rows built from now on start from ``cfg['inits'][seed]`` and
        see the windows of ``seed``."""
        from experiments.text import TextWindows, load_corpus

        self.cfg = {**self.cfg, "seed": seed}
        self.windows = TextWindows(load_corpus().train, None, global_batch=self.cfg["batch"],
                                   context=self.cfg["context"], seed=seed)  # fmt: skip
        self.rows.clear()
        return {}

    def info(self) -> dict[str, Any]:
        """The model's parameter count and f32 gradient bytes."""
        n = sum(p.numel() for p in self._model().parameters())
        return {"params": n, "grad_bytes": 4 * n}


def rank_main(rank: int, world: int, addr: str, port: int, cfg: dict, cmds, results) -> None:
    """A PyTorch rank: joins gloo, then serves the worker's commands until ``stop``.

    Commands (tuples): ``('info',)``, ``('run', row, n)``, ``('eval', row)``,
    ``('reseed', seed)``, ``('stop',)``.
    Answers go on ``results`` as ``(rank, dict)``; a rank that cannot go on answers
    ``(rank, {'fatal': traceback})`` and exits.
    """
    try:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # experiments.text imports jax
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=900),
        )  # fmt: skip
        rows = FSDPRows(rank, world, cfg)
        while True:
            cmd = cmds.get()
            if cmd[0] == "stop":
                break
            handler = {"info": rows.info, "run": rows.run, "eval": rows.evaluate,
                       "reseed": rows.reseed}[cmd[0]]  # fmt: skip
            results.put((rank, handler(*cmd[1:])))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the worker prints it and stops the run
        results.put((rank, {"fatal": traceback.format_exc()}))
