"""Bench only: drain daemons as bench/serve.py --only ttb does, with traces (sitecustomize.py here).

``.venv/bin/python bench/ttb_trace/trace.py KINDS REPS OUTDIR``, KINDS a comma-separated list of
daemon flag sets ("default": none; e.g. ``"default,--jit off"``); then
``legs.py OUTDIR`` (which leg of each slow GET was late), ``gcs.py OUTDIR`` (collections in the
drain), ``sch.py OUTDIR`` (each thread's run-queue wait), and with
``perf sched record -k CLOCK_MONOTONIC -a -- <this command>`` and ``perf sched timehist > TH``:
``tl.py OUTDIR/c.0.default.json TH 5`` (who ran on each core during the 5 slowest GETs).
"""
import os, sys, time, json, gc, tempfile, threading
from pathlib import Path
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import serve as S
if __name__ == "__main__":
  if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
      print(__doc__)
      sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
  kinds = sys.argv[1].split(",")
  reps = int(sys.argv[2])
  outdir = Path(sys.argv[3]); outdir.mkdir(exist_ok=True, parents=True)
now = time.monotonic_ns
cev = []
_gs = {}
def _gccb(phase, info):
    if phase == "start": _gs[0] = now()
    else: cev.append(("cgc", _gs.pop(0, 0), now(), info["generation"]))
gc.callbacks.append(_gccb)
def main():
    from sluice.demo import DATASET_SPEC, RUN_SPEC, build_corpus, stdlib_files
    from sluice.manifest.freeze import freeze
    from sluice.tokenize.pretokenize import pretokenize
    from sluice.tokenize.train import train_bpe
    with tempfile.TemporaryDirectory(prefix="ttbtrace-") as tmp:
        work = Path(tmp)
        train_bpe([str(p) for p in stdlib_files(60)], work / "tokenizer.json", vocab_size=4096)
        build_corpus(work, files=160, per_shard=200)
        (work / "dataset.toml").write_text(DATASET_SPEC.replace("seq_len = 128", "seq_len = 2048"))
        (work / "run.toml").write_text(RUN_SPEC)
        manifest = freeze(work / "dataset.toml", work / "manifest.json", progress=False)
        derived = pretokenize(manifest, work / "tok", workers=2, progress=False)
        os.environ["TTB_TRACE_OUT"] = str(outdir / "d")
        os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))
        for rep in range(reps):
            for kind in kinds:
                flags = () if kind == "default" else tuple(kind.split(" "))
                proc, info = S._daemon(Path(derived.path), work / "run.toml", work / "cache7", *flags)
                try:
                    c = S._client(info, credits=1)
                    next(c)
                    lead = c.info["lead_steps"]; mps = c.info["micro_per_step"]
                    lat = []
                    def snap():
                        out = {}
                        for pid in (proc.pid, os.getpid(), *[int(x) for x in os.popen(f"pgrep -P {proc.pid}").read().split()]):
                            try:
                                for tid in os.listdir(f"/proc/{pid}/task"):
                                    comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                                    r, w, n = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                                    out[f"{pid}/{tid}/{comm}"] = (r, w, n)
                            except OSError:
                                pass
                        return out
                    if os.environ.get("TTB_CSLICE"):
                        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import slice as SL
                        for tid in os.listdir("/proc/self/task"):
                            SL.set_slice(int(tid), int(os.environ["TTB_CSLICE"]))
                    s0 = snap()
                    for _ in range(10):
                        S._wait_full(c, lead - 1)
                        it = iter(c)
                        for _i in range(lead * mps):
                            t0 = now(); mb = next(c); t1 = now()
                            lat.append((t0, t1, c.last_wait_s))
                    s1 = snap()
                    sched = {k: [(s1[k][i] - s0.get(k, (0, 0, 0))[i]) for i in range(3)] for k in s1}
                    c.close()
                    time.sleep(0.7)
                finally:
                    S._stop(proc)
                json.dump({"kind": kind, "pid": proc.pid, "lat": lat, "sched": sched, "cev": cev, "load": os.getloadavg()[0]},
                          open(outdir / f"c.{rep}.{kind.replace(' ','_')}.json", "w"))
                cev.clear()
if __name__ == '__main__':
    main()
