"""`make bench-aggregate`: the cost of each aggregation path and of ``train.deterministic``.

    python -m benchmarks.aggregate [--device cpu|cuda] [--nodes 200000] [--degree 25]
        [--widths 64,256] [--heads 4] [--repeats 5] [--seed 0] [--out runs/bench/aggregate.h5]

One random square block (``--nodes`` destinations = sources, ``--degree`` uniform random in-edges
each: products-like degree at the default), and for every width D of ``--widths`` and every path
it times one forward + backward (gradient of the input rows) of two operators:

* ``sum``: the edge-weighted sum that GCN and SAGE aggregate with (weights constant);
* ``gat``: one standard GAT layer (``--heads`` heads of D / heads columns each: projection,
  edge softmax, weighted sum).

Paths: ``native`` (the OpenMP kernels; CPU only), ``torch`` (the device path: CSR SpMM/SDDMM and
segment reductions, ``train.kernels = "torch"``, what CUDA runs) and ``torch-det`` (the same under
``train.deterministic = true``). Figures: milliseconds per forward + backward (best of
``--repeats``, after one warm-up pass that builds the block's cached CSR tensors; CUDA timed with
synchronisation around each pass) and, on CUDA, the allocator's peak above the live tensors during
the pass (``max_memory_allocated``), in MiB. Printed as a table (each path's time over ``torch``'s
in the last column) and written to ``--out`` (format ``hpcgnn-bench-aggregate``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

FORMAT = "hpcgnn-bench-aggregate"
PATHS = ("native", "torch", "torch-det")
OPS = ("sum", "gat")


def random_block(nodes: int, degree: int, seed: int, device: str):
    """A square :class:`~hpcgnn.sampling.block.Block` with ``degree`` uniform random in-edges per
    destination, on ``device``."""
    from hpcgnn.sampling.block import Block

    gen = torch.Generator().manual_seed(seed)
    indptr = torch.arange(0, (nodes + 1) * degree, degree, dtype=torch.int64)
    indices = torch.randint(nodes, (nodes * degree,), generator=gen, dtype=torch.int64)
    return Block(nodes, nodes, indptr, indices).to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_path(op: str, path: str, blk, width: int, heads: int, repeats: int, seed: int,
              device: str) -> dict:
    """{ms, peak_extra_mib (CUDA, else None)} of one forward + backward of ``op`` on ``path``."""
    from hpcgnn.nn import aggregate as agg
    from hpcgnn.nn.conv import GATConv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(blk.num_src, width, generator=gen).to(device).requires_grad_(True)
    backend = "native" if path == "native" else "torch"
    det = path == "torch-det"
    if op == "sum":
        w = torch.rand(blk.num_edges, generator=gen).to(device)

        def fwd():
            return agg.aggregate_sum(blk, x, w, backend=backend, deterministic=det)
    else:
        torch.manual_seed(seed)
        conv = GATConv(width, max(width // heads, 1), heads=heads, variant="standard", backend=backend,
                       deterministic=det).to(device)

        def fwd():
            return conv(blk, x)

    g = None
    best, peak = float("inf"), None
    for i in range(repeats + 1):           # pass 0 warms up (cached CSR tensors, handles)
        x.grad = None
        _sync(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fwd()
        if g is None:
            g = torch.randn(out.shape, generator=gen).to(device)
        out.backward(g)
        _sync(device)
        dt = time.perf_counter() - t0
        if i:
            best = min(best, dt)
            if device.startswith("cuda"):
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                peak = extra if peak is None else max(peak, extra)
        del out
    return {"ms": best * 1e3, "peak_extra_mib": peak}


def run(args) -> list[dict]:
    """Every (op, width, path) row."""
    blk = random_block(args.nodes, args.degree, args.seed, args.device)
    rows = []
    for op in OPS:
        for width in args.widths:
            for path in PATHS:
                row = {"op": op, "width": width, "path": path, "ms": None, "peak_extra_mib": None, "error": ""}
                if path == "native" and args.device != "cpu":
                    row["error"] = "CPU only"
                else:
                    try:
                        row.update(time_path(op, path, blk, width, args.heads, args.repeats, args.seed,
                                             args.device))
                    except RuntimeError as exc:     # e.g. an operator without a deterministic kernel
                        row["error"] = str(exc).splitlines()[0][:160]
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    from benchmarks.table import cell

    ref = {(r["op"], r["width"]): r["ms"] for r in rows if r["path"] == "torch"}
    head = f"{'op':<5} {'width':>5} {'path':<10} {'ms fwd+bwd':>11} {'peak extra MiB':>14} {'/ torch':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        base = ref.get((r["op"], r["width"]))
        ratio = r["ms"] / base if r["ms"] is not None and base else None
        lines.append(f"{r['op']:<5} {r['width']:>5} {r['path']:<10} {cell(r['ms'], '.2f'):>11} "
                     f"{cell(r['peak_extra_mib'], '.1f'):>14} {cell(ratio, '.2f'):>8}"
                     + (f"  {r['error']}" if r["error"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.aggregate", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--degree", type=int, default=25)
    p.add_argument("--widths", default="64,256", help="comma-separated row widths")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--out", default="runs/bench/aggregate.h5")
    args = p.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths {args.widths!r}: expected integers, comma-separated")
    if min(args.widths) < 1 or args.nodes < 1 or args.degree < 1 or args.repeats < 1 or args.heads < 1:
        p.error("--nodes, --degree, --widths, --heads and --repeats must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench-aggregate: no CUDA GPU visible to PyTorch {torch.__version__}; run with --device cpu")
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = run(args)
    from benchmarks.results_file import write_results

    attrs = {"device": args.device, "nodes": args.nodes, "degree": args.degree, "heads": args.heads,
             "repeats": args.repeats, "seed": args.seed, "torch": torch.__version__,
             "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.device.startswith("cuda"):
        attrs["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    write_results(args.out, {"rows": [{k: v for k, v in r.items() if v is not None} for r in rows]}, attrs, FORMAT)
    print(f"bench-aggregate: {attrs.get('gpu', args.device)}, {args.nodes} nodes x degree {args.degree}, "
          f"{torch.get_num_threads()} CPU threads ({args.out})")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
