"""Golden hashes: the bytes mergefs writes and serves today, pinned by sha256.

Guards restructures of the package: every case here must keep producing exactly the bytes
recorded in ``tests/golden_hashes.json``. So this file uses only what survives moving modules
around: the command line (run as a subprocess) and the names ``mergefs/__init__.py`` exports
(``mergefs.open``, ``mergefs.replay``). It imports no ``mergefs.<module>`` and no test helper:
the tiny checkpoint family is built here, with numpy, safetensors and tokenizers, from fixed
seeds.

Cases (each named in a failure):

- ``merge/<method>/<dtype>/<budget>``: every method of ``mergefs methods`` x output dtype
  (float32, bfloat16, float16) x budget (full, 30%), through ``mergefs.open(spec).merge``;
- ``mergefs mount`` of two of those specs at once (FUSE): every file served has the hash
  pinned for the merge; each mount's manifest replays (``mergefs replay``);
- ``mergefs merge`` (the command) of one of them writes its pinned bytes;
- ``sweep_mount/<variant>``: a sweep mount (grid and named variants), each variant's files;
- ``lora/<budget>``: a ``model+lora`` expert (a PEFT-layout adapter written here);
- ``slices/<name>``: mergekit ``slices:`` specs (a gradient merge and a passthrough stack);
- ``tokenizer/union``: a tokenizer union over experts with different vocabularies;
- replay: ``mergefs replay MANIFEST --out DIR`` re-merges a DARE merge to its pinned hashes;
  ``mergefs.replay(manifest, out=...)`` likewise for the lora, slices and tokenizer cases; the
  sweep mount's manifest replays every variant;
- the seeded DARE/DELLA merges are run twice and give the same bytes.

What is hashed: every file of the output directory except the hidden ``.mergefs/`` directory
(``merge.json`` holds the creation time and absolute paths of the spec and manifest; under a
mount, ``stats.json`` and the live manifest hold counters, times and pids). Manifests (times,
absolute paths, wall-clock totals) are not hashed either; they are only replayed. The model
card (``README.md``) and ``mergekit_config.yml`` are pinned as present, not hashed: they show
the spec and model paths (absolute, temporary here) and are named after the output directory
(tests/engine/test_card.py and tests/cli/test_mergekit_flags.py test their content).

The bytes depend on the environment ``scripts/setup.sh`` pins: torch's CPU kernels (the methods
that are not elementwise), numba's (task_arithmetic, linear) and, for ``tokenizer/union``,
transformers (it writes the output tokenizer files). ``passthrough`` of one model has no base to
fall back on, so its 30% budget reads everything and equals its full merge.

To re-record (only when a change of output bytes is intended):
``python tests/test_golden.py --record`` (or ``MERGEFS_GOLDEN_RECORD=1 pytest
tests/test_golden.py``), which rewrites ``tests/golden_hashes.json``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

import mergefs

HERE = Path(__file__).resolve().parent
GOLDEN_PATH = HERE / "golden_hashes.json"
RECORD = os.environ.get("MERGEFS_GOLDEN_RECORD") == "1"

# -- the family ---------------------------------------------------------------------------------

HIDDEN = 48
INTER = 64
LAYERS = 3
WORDS = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(3, 64)]]  # vocab 64
N_EXPERTS = 3
BLOCK = 1024  # bytes: 5 rows of a 48-wide float32 tensor
#: identical to the base in every expert (zero-delta tensors)
UNTOUCHED = ("model.layers.1.self_attn.q_proj.weight", "model.norm.weight")
INT_TENSOR = "buffers.position_ids"
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
#: the tokenizer family: new words of each expert (different vocabulary sizes)
EXTRA_WORDS = (["alpha", "beta"], ["beta", "gamma", "delta"], [])

DTYPES = ("float32", "bfloat16", "float16")
BUDGETS = ("full", "30%")


@dataclass(frozen=True)
class Family:
    root: Path  # holds base/, expert-0/, ... (relative paths of specs start here)
    experts: tuple[str, ...]


def float_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (vocab, HIDDEN),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "self_attn.q_proj.bias"] = (HIDDEN,)
        shapes[p + "mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
    return dict(sorted(shapes.items()))


def base_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
    return w + np.float32(1.0) if name.endswith("norm.weight") else w


def expert_tensor(rng: np.random.Generator, w0: np.ndarray) -> np.ndarray:
    """``w0`` plus a row-scaled delta (about 1% relative), with a run of 30% of its rows (at a
    seeded position) left equal to the base: zero-delta blocks for the plans."""
    rows = w0.shape[0]
    scale = 0.01 * float(np.sqrt(np.mean(w0.astype(np.float64) ** 2))) * rng.uniform(0.5, 2.0)
    row_scale = np.exp(rng.uniform(np.log(0.25), np.log(4.0), size=rows)).astype(np.float32)
    row_scale = row_scale.reshape((rows,) + (1,) * (w0.ndim - 1))
    w = (w0 + rng.normal(0.0, scale, size=w0.shape).astype(np.float32) * row_scale)
    w = w.astype(np.float32)
    n_same = int(0.3 * rows)
    start = int(rng.integers(0, rows - n_same + 1))
    w[start:start + n_same] = w0[start:start + n_same]
    return w


def tokenizer_files(words: list[str]) -> dict[str, str]:
    """A word-level fast tokenizer (``tokenizer.json``) and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 64}
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_model(path: Path, tensors: dict[str, np.ndarray], words: list[str]) -> None:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": len(words),
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, text in tokenizer_files(words).items():
        (path / name).write_text(text)


def build_family(root: Path, *, seed: int = 0, vocabularies: bool = False) -> Family:
    """``root/base`` and ``root/expert-{0,1,2}``, float32, one ``model.safetensors`` each.

    ``vocabularies``: expert i also has the words ``EXTRA_WORDS[i]`` (its vocabulary tensors
    get rows for them), for the tokenizer merge."""
    rng = np.random.default_rng(seed)
    base = {name: base_tensor(rng, name, shape) for name, shape in float_shapes(64).items()}
    ints = {INT_TENSOR: np.arange(16, dtype=np.int64).reshape(1, 16)}
    write_model(root / "base", {**base, **ints}, WORDS)
    experts = []
    for i in range(N_EXPERTS):
        tensors = {name: w0 if name in UNTOUCHED else expert_tensor(rng, w0)
                   for name, w0 in base.items()}
        words = list(WORDS)
        if vocabularies and EXTRA_WORDS[i]:
            words += EXTRA_WORDS[i]
            for name in VOCAB_TENSORS:
                new = rng.normal(0.0, 0.02, size=(len(EXTRA_WORDS[i]), HIDDEN))
                tensors[name] = np.concatenate([tensors[name], new.astype(np.float32)])
        write_model(root / f"expert-{i}", {**tensors, **ints}, words)
        experts.append(f"expert-{i}")
    return Family(root, tuple(experts))


def write_adapter(path: Path, seed: int = 11) -> Path:
    """A PEFT LoRA adapter on the family's base, laid out as PEFT saves one: factors of q_proj
    (all layers, alpha 3 by ``alpha_pattern``), of up_proj (rank 2 by ``rank_pattern``), of the
    embedding (``lora_embedding_A/B``), and a full ``lm_head`` (``modules_to_save``)."""
    rng = np.random.default_rng(seed)
    r = 4
    tensors: dict[str, np.ndarray] = {}
    pre = "base_model.model."
    for layer in range(LAYERS):
        m = f"{pre}model.layers.{layer}."
        tensors[m + "self_attn.q_proj.lora_A.weight"] = rng.normal(0, 0.05, (r, HIDDEN))
        tensors[m + "self_attn.q_proj.lora_B.weight"] = rng.normal(0, 0.01, (HIDDEN, r))
        tensors[m + "mlp.up_proj.lora_A.weight"] = rng.normal(0, 0.05, (2, HIDDEN))
        tensors[m + "mlp.up_proj.lora_B.weight"] = rng.normal(0, 0.01, (INTER, 2))
    tensors[pre + "model.embed_tokens.lora_embedding_A"] = rng.normal(0, 0.05, (r, len(WORDS)))
    tensors[pre + "model.embed_tokens.lora_embedding_B"] = rng.normal(0, 0.01, (HIDDEN, r))
    tensors[pre + "lm_head.weight"] = rng.normal(0, 0.02, (len(WORDS), HIDDEN))
    path.mkdir(parents=True)
    save_file({k: v.astype(np.float32) for k, v in sorted(tensors.items())},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "use_rslora": False,
              "target_modules": ["q_proj", "up_proj", "embed_tokens"],
              "rank_pattern": {"up_proj": 2}, "alpha_pattern": {"q_proj": 3},
              "modules_to_save": ["lm_head"], "fan_in_fan_out": False, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# -- the merge matrix -----------------------------------------------------------------------------

W3 = [0.5, 0.3, 0.2]
W2 = [0.6, 0.4]
SEED = 7  # mergefs' seed of the DARE/DELLA masks (counter-based: reproducible)

#: method -> (experts, has base_model, weights, per-model parameters, global parameters)
METHOD_SPECS: dict[str, tuple[int, bool, list[float] | None, list[dict[str, Any]] | None,
                              dict[str, Any]]] = {
    "linear": (3, False, W3, None, {}),
    "task_arithmetic": (3, True, W3, None, {"lambda": 0.7}),
    "ties": (3, True, W3, [{"density": 0.5}, {"density": 0.3}, {"density": 0.8}], {}),
    "dare_ties": (3, True, W3, [{"density": 0.6}, {"density": 0.5}, {"density": 0.7}],
                  {"lambda": 1.3, "seed": SEED}),
    "dare_linear": (3, True, W3, None, {"density": 0.7, "seed": SEED}),
    "breadcrumbs": (3, True, W3, None, {"density": 0.9, "gamma": 0.05}),
    "breadcrumbs_ties": (3, True, W3, None, {"density": 0.7, "gamma": 0.1}),
    "della": (3, True, W3, None, {"density": 0.5, "epsilon": 0.1, "seed": SEED}),
    "della_linear": (3, True, W3, None,
                     {"density": 0.7, "epsilon": 0.15, "lambda": 1.1, "seed": SEED}),
    "slerp": (1, True, None, None, {"t": 0.35}),
    "nuslerp": (2, True, W2, None, {}),
    "model_stock": (3, True, None, None, {}),
    "sce": (3, True, None, None, {"select_topk": 0.5}),
    "multislerp": (2, True, W2, None, {}),
    "karcher": (2, True, None, None, {"max_iter": 5, "tol": 1e-6}),
    "nearswap": (1, True, None, None, {"t": 0.0005}),
    "passthrough": (1, False, None, [{"scale": 0.5}], {}),
    "arcee_fusion": (1, True, None, None, {}),
    "ram": (2, True, None, None, {"epsilon": 1e-4}),
    "ramplus_tl": (2, True, None, None, {"r": 0.2, "alpha": 0.3}),
    "magmax": (3, True, None, None, {"scaling_factor": 0.8}),
    "consensus_ta": (3, True, W3, None, {"k": 2, "lambda": 0.6}),
    "consensus_ties": (3, True, W3, None, {"density": 0.5, "k": 2, "lambda": 0.8}),
    "tsv_m": (3, True, W3, None, {"alpha": 0.8}),
    "iso_c": (3, True, None, None, {"scaling_factor": 0.9}),
    "iso_cts": (3, True, None, None, {"common_space_fraction": 0.6}),
}
RANDOM_METHODS = ("dare_ties", "dare_linear", "della", "della_linear")

MATRIX = [f"merge/{m}/{d}/{b}" for m in METHOD_SPECS for d in DTYPES for b in BUDGETS]


def method_spec(fam: Family, method: str, dtype: str, budget: str, index_dir: Path
                ) -> dict[str, Any]:
    n, has_base, weights, model_params, params = METHOD_SPECS[method]
    models = []
    for i in range(n):
        p: dict[str, Any] = {}
        if weights is not None:
            p["weight"] = weights[i]
        if model_params is not None:
            p.update(model_params[i])
        models.append({"model": fam.experts[i], **({"parameters": p} if p else {})})
    doc: dict[str, Any] = {"merge_method": method}
    if has_base:
        doc["base_model"] = "base"
    doc["models"] = models
    if params:
        doc["parameters"] = dict(params)
    doc.update(out_dtype=dtype, budget=budget, block_size=BLOCK, index_dir=str(index_dir))
    return doc


# -- helpers ------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: files of an output pinned as present, not hashed (see the module docstring)
UNHASHED = {"README.md": "present (the model card: not hashed)",
            "mergekit_config.yml": "present (the spec's text: not hashed)"}


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path, hidden entries skipped (the
    ``.mergefs/`` directory: creation times, pids, counters, absolute paths); the model card's
    files only marked present (:data:`UNHASHED`)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith("."):
                p = Path(dirpath) / f
                rel = p.relative_to(root).as_posix()
                out[rel] = UNHASHED[rel] if rel in UNHASHED else sha256(p)
    return dict(sorted(out.items()))


def cli() -> list[str]:
    """The mergefs command: ``python -m mergefs`` if the package has a ``__main__``, else the
    console script installed beside this interpreter."""
    if importlib.util.find_spec("mergefs.__main__") is not None:
        return [sys.executable, "-m", "mergefs"]
    return [str(Path(sys.executable).parent / "mergefs")]


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli(), *argv], capture_output=True, text=True, timeout=timeout,
                          check=False)


def load_golden() -> dict[str, dict[str, str]]:
    if not GOLDEN_PATH.exists():
        return {}
    return json.loads(GOLDEN_PATH.read_text())["cases"]


GOLDEN = load_golden()
RECORDED: dict[str, dict[str, str]] = {}


def check(case: str, got: dict[str, str]) -> None:
    """Compare ``got`` (relative path -> sha256) with the golden hashes of ``case`` (in record
    mode: record them instead)."""
    assert got, f"{case}: no output files"
    if RECORD:
        if case in RECORDED:
            assert RECORDED[case] == got, f"{case}: differs between two runs of the same case"
        RECORDED[case] = got
        return
    want = GOLDEN.get(case)
    assert want is not None, f"{case}: not in {GOLDEN_PATH.name} (re-record: see the docstring)"
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, f"{case}: files missing {missing}, unexpected {extra}"
    changed = [f for f in want if want[f] != got[f]]
    assert not changed, f"{case}: bytes changed in {changed}"


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def record_golden() -> Iterator[None]:
    """In record mode, write every case recorded by this module's tests to the JSON file."""
    yield
    if RECORD and RECORDED:
        cases = {**load_golden(), **RECORDED}
        doc = {"comment": "sha256 of merged output files; written by `python "
                          "tests/test_golden.py --record` (see its docstring)",
               "cases": dict(sorted(cases.items()))}
        GOLDEN_PATH.write_text(json.dumps(doc, indent=1) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("golden")


@pytest.fixture(scope="module")
def fam(work: Path) -> Family:
    return build_family(work / "fam", seed=0)


@pytest.fixture(scope="module")
def index_dir(work: Path) -> Path:
    return work / "index"


def merge_doc(doc: dict[str, Any], base_dir: Path, out: Path) -> Any:
    """``mergefs.open(doc).merge(out)`` with its own manifest beside ``out``."""
    return mergefs.open(doc, base_dir=base_dir).merge(out, manifest=Path(f"{out}.manifest.jsonl"))


def run_matrix_case(fam: Family, case: str, runs: Path, index_dir: Path) -> dict[str, str]:
    _, method, dtype, budget = case.split("/")
    out = runs / case.replace("/", "_").replace("%", "pct")
    merge_doc(method_spec(fam, method, dtype, budget, index_dir), fam.root, out)
    return hash_tree(out)


# -- 1. every method x dtype x budget -----------------------------------------------------------


def test_method_list_is_pinned() -> None:
    """The methods ``mergefs methods`` lists are exactly the ones pinned here."""
    res = run_cli("methods", "--json")
    assert res.returncode == 0, res.stderr
    assert sorted(r["name"] for r in json.loads(res.stdout)) == sorted(METHOD_SPECS)


@pytest.mark.parametrize("case", MATRIX)
def test_merge(case: str, fam: Family, work: Path, index_dir: Path) -> None:
    check(case, run_matrix_case(fam, case, work / "runs", index_dir))


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_random_methods_are_reproducible(method: str, fam: Family, work: Path,
                                         index_dir: Path) -> None:
    """A second run of a seeded DARE/DELLA merge writes the same bytes (not recorded again)."""
    case = f"merge/{method}/float32/30%"
    first = run_matrix_case(fam, case, work / "runs-a", index_dir)
    second = run_matrix_case(fam, case, work / "runs-b", index_dir)
    assert first == second
    check(case, second)


# -- 4.-6. a LoRA expert, slices, a tokenizer merge ---------------------------------------------

def lora_doc(budget: str, index_dir: Path) -> dict[str, Any]:
    """task_arithmetic of ``base+adapter`` (mergekit's MODEL+LORA) and a full expert."""
    return {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "base+adapter", "parameters": {"weight": 0.6}},
                       {"model": "expert-0", "parameters": {"weight": 0.3}}],
            "parameters": {"lambda": 1.0}, "out_dtype": "float32", "budget": budget,
            "block_size": BLOCK, "index_dir": str(index_dir)}


def slices_docs(index_dir: Path) -> dict[str, dict[str, Any]]:
    common = {"block_size": BLOCK, "index_dir": str(index_dir)}
    return {
        # two slices over different layer ranges, gradients and a filter: 4 output layers
        "slices/task_arithmetic_gradients": {
            "merge_method": "task_arithmetic", "base_model": "base",
            "slices": [
                {"sources": [{"model": "base", "layer_range": [0, 2]},
                             {"model": "expert-0", "layer_range": [0, 2],
                              "parameters": {"weight": [1.0, 0.2]}},
                             {"model": "expert-1", "layer_range": [0, 2]}],
                 "parameters": {"weight": 0.5}},
                {"sources": [{"model": "base", "layer_range": [1, 3]},
                             {"model": "expert-0", "layer_range": [1, 3]},
                             {"model": "expert-1", "layer_range": [1, 3]}],
                 "parameters": {"weight": [{"filter": "mlp", "value": [0.1, 0.9]},
                                           {"value": 0.4}]}}],
            "parameters": {"lambda": 0.9}, "out_dtype": "bfloat16", "budget": "40%", **common},
        # a passthrough frankenmerge: layers of two models stacked, a scale filter on a copy
        "slices/passthrough_stack": {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": "expert-0", "layer_range": [0, 2]}]},
                {"sources": [{"model": "expert-1", "layer_range": [1, 3]}],
                 "parameters": {"scale": [{"filter": "up_proj", "value": 0.5},
                                          {"value": 1.0}]}},
                {"sources": [{"model": "expert-0", "layer_range": [2, 3]}]}],
            "out_dtype": "float16", **common},
    }


def tokenizer_doc(index_dir: Path) -> dict[str, Any]:
    """A union of three vocabularies (base, base + 2 words, base + 3 words) with token rules,
    padding and an inline chat template (no mergekit needed)."""
    return {
        "merge_method": "task_arithmetic", "base_model": "base",
        "models": [{"model": "expert-0", "parameters": {"weight": 0.6}},
                   {"model": "expert-1", "parameters": {"weight": 0.3}},
                   {"model": "expert-2", "parameters": {"weight": 0.2}}],
        "tokenizer": {"source": "union", "pad_to_multiple_of": 8,
                      "tokens": {"alpha": {"source": {"kind": "zero"}, "force": True},
                                 "gamma": {"source": {"kind": "model_token",
                                                      "model": "expert-0", "token": "w3"}}}},
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}",
        "out_dtype": "bfloat16", "budget": "40%", "block_size": BLOCK,
        "index_dir": str(index_dir)}


@pytest.fixture(scope="module")
def adapter(fam: Family) -> Path:
    return write_adapter(fam.root / "adapter")


def merge_and_replay(case: str, doc: dict[str, Any], base_dir: Path, work: Path) -> None:
    """Merge ``doc``, check its hashes, then ``mergefs.replay(manifest, out=...)`` must verify
    every recorded byte and write the same files again."""
    out = work / "special" / case.replace("/", "_").replace("%", "pct")
    res = merge_doc(doc, base_dir, out)
    got = hash_tree(out)
    check(case, got)
    again = Path(f"{out}-replayed")
    replayed = mergefs.replay(res.manifest, out=again)
    assert replayed.outputs_verified > 0
    assert hash_tree(again) == got, f"{case}: replay wrote other bytes"


@pytest.mark.parametrize("budget", BUDGETS)
def test_lora_expert(budget: str, fam: Family, adapter: Path, work: Path,
                     index_dir: Path) -> None:
    merge_and_replay(f"lora/{budget}", lora_doc(budget, index_dir), fam.root, work)


@pytest.mark.parametrize("case", ["slices/task_arithmetic_gradients", "slices/passthrough_stack"])
def test_slices(case: str, fam: Family, work: Path, index_dir: Path) -> None:
    merge_and_replay(case, slices_docs(index_dir)[case], fam.root, work)


def test_tokenizer_union(work: Path) -> None:
    pytest.importorskip("transformers")
    vocab_fam = build_family(work / "vocab_fam", seed=1, vocabularies=True)
    merge_and_replay("tokenizer/union", tokenizer_doc(work / "vocab_index"), vocab_fam.root, work)


# -- 7. the command line: merge, then replay -------------------------------------------------------

REPLAY_CASE = "merge/dare_ties/bfloat16/30%"


def write_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_cli_merge_and_replay(fam: Family, work: Path, index_dir: Path) -> None:
    """``mergefs merge SPEC OUT`` writes the bytes pinned for the same spec merged through the
    API, and ``mergefs replay MANIFEST --out DIR`` re-merges them, verified, to the same bytes."""
    _, method, dtype, budget = REPLAY_CASE.split("/")
    spec = write_yaml(fam.root / "cli-replay.yaml",
                      method_spec(fam, method, dtype, budget, index_dir))
    out, manifest = work / "cli-out", work / "cli-out.manifest.jsonl"
    res = run_cli("merge", str(spec), str(out), "--manifest", str(manifest))
    assert res.returncode == 0, res.stderr
    check(REPLAY_CASE, hash_tree(out))
    res = run_cli("replay", str(manifest), "--out", str(work / "cli-replayed"))
    assert res.returncode == 0, res.stdout + res.stderr
    check(REPLAY_CASE, hash_tree(work / "cli-replayed"))


# -- 2.-3. mounts (FUSE) ------------------------------------------------------------------------

no_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")
MOUNT_CASES = ("merge/task_arithmetic/float16/30%", "merge/dare_ties/bfloat16/30%")
READY_SECONDS = 60.0


@dataclass
class Mount:
    path: Path
    proc: subprocess.Popen[bytes]
    log: Path


class Mounts:
    """``mergefs mount SPEC MNT --foreground`` servers; ``stop_all`` always unmounts."""

    def __init__(self) -> None:
        self.started: list[Mount] = []

    def start(self, spec: Path, mnt: Path) -> Mount:
        mnt.mkdir()
        log = Path(f"{mnt}.log")
        with open(log, "wb") as f:
            proc = subprocess.Popen([*cli(), "mount", str(spec), str(mnt), "--foreground",
                                     "--cache-size", "4MiB"], stdout=f, stderr=subprocess.STDOUT)
        m = Mount(mnt, proc, log)
        self.started.append(m)
        return m

    @staticmethod
    def wait_ready(m: Mount) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while not (m.path / ".mergefs" / "stats.json").exists():
            if m.proc.poll() is not None:
                raise AssertionError(f"mount exited {m.proc.returncode}: {m.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"mount not ready: {m.log.read_text()}")
            time.sleep(0.05)

    def stop_all(self) -> None:
        for m in self.started:
            if m.proc.poll() is None:
                m.proc.terminate()  # the server unmounts on SIGTERM and writes its totals
                try:
                    m.proc.wait(30)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True,
                           check=False)


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    m = Mounts()
    try:
        yield m
    finally:
        m.stop_all()


@pytest.mark.mount
@no_fuse
def test_mount_serves_the_merge(fam: Family, work: Path, index_dir: Path,
                                mounts: Mounts) -> None:
    """Two specs of the matrix mounted at once: every file served has the merge's pinned hash;
    then each mount's manifest replays."""
    started = []
    for k, case in enumerate(MOUNT_CASES):
        _, method, dtype, budget = case.split("/")
        doc = method_spec(fam, method, dtype, budget, index_dir)
        doc["manifest"] = str(work / f"mount-{k}.manifest.jsonl")
        spec = write_yaml(fam.root / f"mount-{k}.yaml", doc)
        started.append((case, doc["manifest"], mounts.start(spec, work / f"mnt-{k}")))
    for case, _, m in started:
        mounts.wait_ready(m)
        check(case, hash_tree(m.path))
    mounts.stop_all()
    replays = []  # both at once: each process spends seconds importing and compiling
    for case, manifest, m in started:
        assert m.proc.returncode == 0, m.log.read_text()
        replays.append((case, subprocess.Popen([*cli(), "replay", manifest], text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for case, proc in replays:
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, f"{case}: {output}"


SWEEP = {"weight": [0.2, [0.7, -0.4, 0.3]], "budget": ["30%", "full"]}
SWEEP_VARIANTS = [
    {"name": "strong-bf16", "weight": 1.0, "parameters.lambda": 1.5, "out_dtype": "bfloat16"},
    {"name": "ties-f16", "merge_method": "ties", "weight": 0.5, "parameters.density": 0.5,
     "out_dtype": "float16", "budget": "30%"},
]


@pytest.mark.mount
@no_fuse
def test_sweep_mount(fam: Family, work: Path, index_dir: Path,
                     mounts: Mounts) -> None:
    """A sweep mount (a 2 x 2 grid and two named variants): each variant's files; one variant
    equals ``mergefs merge --variant``; the sweep manifest replays every variant."""
    doc = {"merge_method": "task_arithmetic", "base_model": "base",
           "models": [{"model": e} for e in fam.experts], "parameters": {"lambda": 1.0},
           "block_size": BLOCK, "index_dir": str(index_dir),
           "manifest": str(work / "sweep.manifest.jsonl"), "sweep": SWEEP,
           "variants": SWEEP_VARIANTS}
    spec = write_yaml(fam.root / "sweep.yaml", doc)
    m = mounts.start(spec, work / "mnt-sweep")
    out = work / "sweep-variant-out"  # merged meanwhile (both spend seconds starting up)
    merging = subprocess.Popen([*cli(), "merge", str(spec), str(out), "--variant", "strong-bf16",
                                "--manifest", f"{out}.manifest.jsonl"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        mounts.wait_ready(m)
        listed = json.loads((m.path / "variants.json").read_text())["variants"]
        names = sorted(v["name"] for v in listed)
        # variants.json is not hashed: it holds each variant's resolved spec (absolute paths)
        assert sorted(os.listdir(m.path)) == sorted([*names, ".mergefs", "variants.json"])
        if not RECORD:
            assert names == sorted(c.split("/", 1)[1] for c in GOLDEN
                                   if c.startswith("sweep_mount/"))
        served = {}
        for name in names:
            served[name] = hash_tree(m.path / name)
            check(f"sweep_mount/{name}", served[name])
        output = merging.communicate(timeout=120)[0]
        assert merging.returncode == 0, output
        assert hash_tree(out) == served["strong-bf16"]
    finally:
        if merging.poll() is None:
            merging.kill()
            merging.wait()
    mounts.stop_all()
    assert m.proc.returncode == 0, m.log.read_text()
    res = run_cli("replay", doc["manifest"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(" OK (plan ") == len(names), res.stdout


# -- the golden file itself -----------------------------------------------------------------------


def test_golden_file_has_no_stale_cases() -> None:
    """Every case in the JSON is one this file checks (the sweep's names come from the mount)."""
    if RECORD:
        pytest.skip("recording")
    known = set(MATRIX) | {f"lora/{b}" for b in BUDGETS} | set(slices_docs(Path("."))) | {
        "tokenizer/union"}
    stale = {c for c in GOLDEN if c not in known and not c.startswith("sweep_mount/")}
    assert not stale, f"cases in {GOLDEN_PATH.name} that no test checks: {sorted(stale)}"
    assert known <= set(GOLDEN), sorted(known - set(GOLDEN))


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {sys.argv[0]} --record   (rewrites {GOLDEN_PATH})")
    os.environ["MERGEFS_GOLDEN_RECORD"] = "1"
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(Path(__file__).resolve())], cwd=HERE.parent))
