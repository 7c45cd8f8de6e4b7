"""Per-rank bodies of the distributed tests (run by ``_launch.run_workers`` in spawned processes).

Each case trains one step of a tiny HSTU model twice, eagerly and with ``backend="hstu"``, under
the same distributed wrapper, from the same weights and per-rank batches, and returns plain data:
rewrite counts, near misses, Dynamo graph/recompile counts, losses, gradients, collective counts.

Speed: the backend's Inductor step is replaced by ``aot_eager`` as in ``backend="hstu_eager"``
(``fast_inner_compile``). What is under test is what reaches the compiler (the rewrites, the DDP
split, the gradients through the hstu ops' autograd); Inductor's code generation for the pieces is
the same as without DDP and is covered by the single-process tests (and by the ``slow`` test that
keeps Inductor on).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

NUM_ITEMS, MAX_LEN, LAYERS = 30, 8, 2
RANK_LENGTHS = ([5, 0, 1, 8, 3], [2, 8, 4, 1, 2])  # same total L (the sharded lookup needs it)
SMALL_BUCKET_BYTES = 4096  # with the tiny model, several DDP buckets (and DDPOptimizer splits)


def fast_inner_compile() -> list:
    """Compile what the backend hands to Inductor as ``backend="hstu_eager"`` does (``aot_eager``,
    hstu ops kept whole) instead; returns the list of graphs it receives (one per compiled piece)."""
    import hstu_inductor

    pieces = []
    aot_eager = hstu_inductor._compat.aot_eager

    def compile_fx(gm, example_inputs, config_patches=None):
        pieces.append(gm)
        return aot_eager(gm, example_inputs)

    hstu_inductor._compat.compile_fx = compile_fx
    return pieces


def small_buckets() -> None:
    """DDP and the DDPOptimizer both start with a 1 MiB first bucket; shrink it so the tiny test
    model is split into several buckets, as a real model is."""
    dist._DEFAULT_FIRST_BUCKET_BYTES = SMALL_BUCKET_BYTES


def hstu_model(seed=0):
    from hstu_inductor.reference import HSTUModel

    torch.manual_seed(seed)
    return HSTUModel(NUM_ITEMS, MAX_LEN, embedding_dim=16, num_layers=LAYERS, num_heads=2, attn_dim=8, hidden_dim=8)


def rank_batch(rank):
    """(ids, offsets, labels): fresh random ids per rank; lengths include 0, 1 and MAX_LEN."""
    lengths = RANK_LENGTHS[rank % len(RANK_LENGTHS)]
    g = torch.Generator().manual_seed(100 + rank)
    L = sum(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return (torch.randint(0, NUM_ITEMS, (L,), generator=g), offsets,
            torch.randint(0, NUM_ITEMS, (L,), generator=g))


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class CountingAllreduce:
    """State of :func:`counting_allreduce`: how many buckets DDP reduced."""

    def __init__(self):
        self.calls = 0


def counting_allreduce(state, bucket):
    """DDP comm hook: the default averaging allreduce, counted."""
    state.calls += 1
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
            "graph_breaks": sorted(k.splitlines()[0] for k in counters["graph_break"])}


def run_step(step, model, *batch):
    """One forward/backward under the rewrite collector; (report, loss, grads in parameter order)."""
    from hstu_inductor.report import collecting

    with collecting() as report:
        loss = step(*batch)
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
    return report, loss.detach(), grads


def compare(eager, compiled) -> dict:
    """Loss and every gradient of a compiled step against the eager step."""
    (_, loss_e, grads_e), (report, loss_c, grads_c) = eager, compiled
    missing = [i for i, (a, b) in enumerate(zip(grads_e, grads_c)) if (a is None) != (b is None)]
    return {"counts": dict(report.counts), "near_misses": list(report.near_misses), "graphs": report.graphs,
            "loss": loss_c.item(), "loss_err": rel_err(loss_c, loss_e), "missing_grads": missing,
            "grad_errs": [rel_err(b, a) for a, b in zip(grads_e, grads_c) if a is not None and b is not None],
            "grad_norm": sum(g.double().norm().item() for g in grads_e if g is not None),
            "grads": [g for g in grads_c if g is not None]}


# ------------------------------------------------------------------------------------------
# DDP
# ------------------------------------------------------------------------------------------

def _ddp_pair(rank, pieces, make_step, sharded_params=0):
    """Run ``make_step(compiled)`` eagerly then compiled (fresh copies of the same weights);
    returns compare() plus DDP allreduce counts, compiled pieces and Dynamo stats."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        comm = CountingAllreduce()
        step, model = make_step(compiled, comm)
        before = len(pieces)
        runs.append((run_step(step, model, *rank_batch(rank)), comm.calls, len(pieces) - before))
    out = compare(runs[0][0], runs[1][0])
    out.update(sharded_params=sharded_params, allreduces_eager=runs[0][1], allreduces_compiled=runs[1][1], pieces=runs[1][2], **dynamo_stats())
    return out


def _ddp_model_step(compiled, comm, base):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    ddp = DDP(model, bucket_cap_mb=SMALL_BUCKET_BYTES / 2**20)
    if comm is not None:
        ddp.register_comm_hook(comm, counting_allreduce)
    fwd = torch.compile(ddp, backend="hstu") if compiled else ddp

    def step(ids, offsets, labels):
        loss = F.cross_entropy(fwd(ids, offsets), labels)
        loss.backward()
        return loss

    return step, model


def case_ddp(rank, world, pieces):
    base = hstu_model()
    return _ddp_pair(rank, pieces, lambda compiled, comm: _ddp_model_step(compiled, comm, base))


class _ShardedLookup(torch.autograd.Function):
    """Row-wise sharded embedding lookup (torchrec-style model parallelism): every rank looks up
    the rows it owns for all ranks' ids, an allreduce sums the partial rows, each rank keeps its
    own batch; backward allgathers the batch gradients and each rank accumulates its own rows."""

    @staticmethod
    def forward(ctx, weight, all_ids, lo, rank, L):
        local = all_ids - lo
        own = (local >= 0) & (local < weight.shape[0])
        rows = torch.zeros(all_ids.numel(), weight.shape[1], dtype=weight.dtype)
        rows[own] = weight[local[own]]
        dist.all_reduce(rows)
        ctx.save_for_backward(local, own)
        ctx.rows, ctx.shape = weight.shape[0], weight.shape
        return rows[rank * L:(rank + 1) * L].clone()

    @staticmethod
    def backward(ctx, grad):
        local, own = ctx.saved_tensors
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        full = torch.cat(parts)
        gw = torch.zeros(ctx.shape, dtype=grad.dtype)
        gw.index_add_(0, local[own], full[own])
        return gw, None, None, None, None


class ShardedEmbedding(nn.Module):
    """This rank's rows ``[lo, lo + rows)`` of an item table; the table is the same on all ranks."""

    def __init__(self, table: torch.Tensor, rank: int, world: int):
        super().__init__()
        per = -(-table.shape[0] // world)
        self.lo, self.rank = rank * per, rank
        self.weight = nn.Parameter(table[self.lo:self.lo + per].clone())

    def forward(self, ids):
        parts = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, ids)
        return _ShardedLookup.apply(self.weight, torch.cat(parts), self.lo, self.rank, ids.numel())


class DenseHSTU(nn.Module):
    """The data-parallel part fed by sharded item embeddings: positions, STU layers, head."""

    def __init__(self, base):
        super().__init__()
        self.pos_emb, self.layers, self.final_norm = base.pos_emb, base.layers, base.final_norm
        self.head = nn.Linear(base.item_emb.weight.shape[1], NUM_ITEMS)

    def forward(self, x, seq_offsets):
        from hstu_inductor.reference.jagged import row_to_sequence

        _, pos = row_to_sequence(seq_offsets, x.shape[0])
        x = x + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x, seq_offsets, MAX_LEN)
        return self.head(self.final_norm(x))


class _ShardedModel(nn.Module):
    def __init__(self, emb, dense):
        super().__init__()
        self.emb, self.dense = emb, dense


def case_sharded_embedding(rank, world, pieces):
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = hstu_model()

    def make(compiled, comm):
        b = copy.deepcopy(base)
        torch.manual_seed(1)
        whole = _ShardedModel(ShardedEmbedding(b.item_emb.weight.detach(), rank, world), DenseHSTU(b))
        ddp = DDP(whole.dense, bucket_cap_mb=SMALL_BUCKET_BYTES / 2**20)
        ddp.register_comm_hook(comm, counting_allreduce)
        dense = torch.compile(ddp, backend="hstu") if compiled else ddp

        def step(ids, offsets, labels):
            loss = F.cross_entropy(dense(whole.emb(ids), offsets), labels)
            loss.backward()
            return loss

        return step, whole

    return _ddp_pair(rank, pieces, make, sharded_params=1)


def case_python_reducer(rank, world, pieces):
    """``optimize_ddp="python_reducer"`` with compiled autograd: no DDPOptimizer split; DDP's
    allreduces are traced into the compiled backward. Eager reference: ordinary DDP."""
    base = hstu_model()

    def make(compiled, comm):
        if not compiled:
            return _ddp_model_step(False, comm, base)
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            inner, model = _ddp_model_step(False, None, base)  # DDP built in python-reducer mode
        step = torch.compile(inner, backend="hstu")

        def run(*batch):
            with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
                return step(*batch)

        return run, model

    return _ddp_pair(rank, pieces, make)


DDP_CASES = {"ddp": case_ddp, "sharded_embedding": case_sharded_embedding, "python_reducer": case_python_reducer}


# ------------------------------------------------------------------------------------------
# FSDP2 (torch.distributed.fsdp.fully_shard on a CPU device mesh)
# ------------------------------------------------------------------------------------------

def _fsdp_model(shard: str, compile_blocks: bool, mesh, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    model = hstu_model()
    for layer in model.layers:
        if shard == "layer":
            fully_shard(layer, mesh=mesh)
        if compiled and compile_blocks:
            layer.compile(backend="hstu")
    fully_shard(model, mesh=mesh)
    fwd = torch.compile(model, backend="hstu") if compiled and not compile_blocks else model
    return model, fwd


def fsdp_variant(rank, mesh, shard: str, comp: str) -> dict:
    """``shard`` "layer" (fully_shard per STU layer, then the root) or "root" (the whole model only);
    ``comp`` "whole" (torch.compile(model)) or "block" (each STU layer's ``.compile()``). Gradients
    compared shard by shard (local tensors)."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model, fwd = _fsdp_model(shard, comp == "block", mesh, compiled)

        def step(ids, offsets, labels):
            loss = F.cross_entropy(fwd(ids, offsets), labels)
            loss.backward()
            return loss

        report, loss, grads = run_step(step, model, *rank_batch(rank))
        runs.append((report, loss, [g.to_local() if g is not None else None for g in grads]))
    res = compare(*runs)
    res.update(**dynamo_stats())
    return res


# ------------------------------------------------------------------------------------------
# One pair of processes for every case
# ------------------------------------------------------------------------------------------

def all_cases(rank, world, names):
    """Each of ``names`` in turn in this process: a DDP_CASES key or an FSDP2 ``(shard, compile)`` variant.
    One pair of processes for all: each spawned process spends seconds importing torch and the package
    before its first case."""
    import hstu_inductor  # noqa: F401  (registers the backend and the DDP pre-split hook)

    pieces = fast_inner_compile()
    small_buckets()
    mesh = None
    out = {}
    for name in names:
        start = time.perf_counter()
        if isinstance(name, tuple):
            if mesh is None:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (world,))
            out[name] = fsdp_variant(rank, mesh, *name)
        else:
            out[name] = DDP_CASES[name](rank, world, pieces)
        out[name]["seconds"] = time.perf_counter() - start
    return out
