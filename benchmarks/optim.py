"""torch.optim.Adam against hpcgnn.nn.optim.Adam: ``python -m benchmarks.optim [--repeats 3]``.

Each run is a fresh interpreter (one thread) that builds the optimizer for a 0.1 M-parameter MLP
and takes its first step (wall and CPU seconds from after ``import torch``), then 300 more steps
(median seconds of ``step()``); it prints one JSON row per run: those figures, the process's peak
resident memory (MiB) and whether TorchDynamo was imported.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, resource, sys, time
import torch
torch.set_num_threads(1)
kind = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 47))
x = torch.randn(1024, 128); y = torch.randint(0, 47, (1024,))
def cpu(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
if kind == "torch":
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.0)
else:
    from hpcgnn.nn.optim import Adam
    opt = Adam(model.parameters(), lr=0.01, weight_decay=0.0)
loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); opt.state_dict()
first_wall, first_cpu = time.perf_counter() - t0, cpu() - c0
steps = []
for _ in range(300):
    loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward()
    t = time.perf_counter(); opt.step(); steps.append(time.perf_counter() - t); opt.zero_grad()
steps.sort()
print(json.dumps({"first_wall": first_wall, "first_cpu": first_cpu, "step_median_us": steps[len(steps)//2] * 1e6,
                  "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "dynamo_imported": "torch._dynamo" in sys.modules}))
'''


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optim", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    for _ in range(args.repeats):
        for kind in ("torch", "hpcgnn"):
            r = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode != 0:
                raise SystemExit(f"benchmarks.optim: the {kind} run failed (exit {r.returncode})\n{r.stderr[-2000:]}")
            print(json.dumps({"optimizer": kind, **json.loads(r.stdout)}))


if __name__ == "__main__":
    main()
