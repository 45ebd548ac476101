"""Reference hash of a small OHFL simulate and a small compare: model weights + metric values (timings, paths,
dates excluded). Usage: python run_hash.py OUTDIR"""
import hashlib, json, sys, subprocess, os
from pathlib import Path
import torch
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
py = sys.executable
env = dict(os.environ)
def sh(*a):
    r = subprocess.run([py, "-m", "nvflare_jobs.cli", *a], env=env, capture_output=True, text=True)
    if r.returncode: print(r.stdout[-3000:], r.stderr[-3000:]); raise SystemExit(r.returncode)
sh("simulate", "--method", "ohfl", "--sites", "3", "--scheme", "width", "--max-train-images", "12",
   "--local-epochs", "1", "--finetune-epochs", "1", "--distill-steps", "5", "--input-sizes", "32,48,64",
   "--out", str(out / "sim"), "--overwrite", "--tracking", "none")
sh("compare", "--methods", "local,fedavg,ohfl:distill_steps=5", "--seeds", "0", "--sites", "3", "--max-train-images", "12",
   "--local-epochs", "1", "--finetune-epochs", "1", "--input-sizes", "32,48,64", "--out", str(out / "cmp"), "--no-audit") if "--no-compare" not in sys.argv else None
from hfl_components.models.files import load_model_file
SKIP = ("time", "_s", "seconds", "path", "command", "profile", "date", "created", "out", "log", "workspace", "version",
        "started", "finished", "host", "dir", "file", "elapsed", "eta", "speed", "per_s", "sha", "code",
        "ratio", "source")
def clean(x, k=""):
    if isinstance(x, dict):
        return {kk: clean(v, kk) for kk, v in sorted(x.items()) if not any(s in kk.lower() for s in SKIP)}
    if isinstance(x, list): return [clean(v, k) for v in x]
    if isinstance(x, float): return round(x, 10)
    if isinstance(x, str) and ("/" in x): return "<path>"
    return x
h = {}
for f in sorted(out.rglob("models/*.pt")) + sorted(out.rglob("global_model*.pt")):
    m, hdr = load_model_file(f)
    d = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()): d.update(k.encode()); d.update(v.detach().cpu().numpy().tobytes())
    h[str(f.relative_to(out))] = d.hexdigest()[:16]
for f in sorted(out.rglob("metrics.json")):
    if "workspace" in f.parts: continue
    h[str(f.relative_to(out))] = hashlib.sha256(json.dumps(clean(json.loads(f.read_text())), sort_keys=True).encode()).hexdigest()[:16]
(out / "hashes.json").write_text(json.dumps(h, indent=1, sort_keys=True))
print(json.dumps(h, indent=1, sort_keys=True))
