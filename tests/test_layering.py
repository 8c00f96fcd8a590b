"""The import graph read from the sources: every project-internal import points down the layer
table, sits at module top, and fid/ stays standalone; no module of sit_vit5/, fid/ or bench/ is
part of an import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Components of sit_vit5 by layer, bottom first: a module may import only from lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("names", "utils"),  # utils: the plumbing (errors, files, launcher), no project import above
    ("latent_norm",),  # latent normalisation: plain numbers for the config checks, tensors for vae
    ("guidance", "vae", "stepwise"),  # stepwise: the step-wise loop of flow solvers and objectives
    ("images", "transport"),
    ("models", "datasets"),  # datasets: the shared dataset base and the embedded digits
    ("sample_spec",),
    ("objective",),
    ("config", "image_data", "diffusion"),  # diffusion: DiT's objective, an Objective subclass
    ("sampling", "latent_cache"),  # latent_cache: the cache's format, writer, reader and verifier
    ("training", "hub"),
    ("export", "pipeline"),  # pipeline: the import path exported folders run
    ("cli", "cache_latents"),  # cache_latents: the command line over latent_cache
    ("experiments",),  # studies over the whole stack; the NFE study takes sample.py's flag types
]
#: The platform: optional layers around the research core (backbones, the SiT objective, samplers,
#: the training step and loop). An entry point or builder imports one only when a config or flag
#: asks for it; a core module never imports one at module top (issue 52).
PLATFORM: tuple[str, ...] = (
    "sit_vit5.diffusion", "sit_vit5.hub", "sit_vit5.pipeline", "sit_vit5.export",
    "sit_vit5.latent_cache", "sit_vit5.cache_latents", "sit_vit5.experiments",
    "sit_vit5.models.official", "sit_vit5.models.diffusers_dit", "sit_vit5.sampling.bulk",
    "sit_vit5.sampling.labels",
    "sit_vit5.training.fsdp", "sit_vit5.training.repa", "sit_vit5.cli",
    "sit_vit5.objective.meanflow", "sit_vit5.models.fused_qk", "sit_vit5.models.tail_attention",
)
#: Core modules that build from a config: each imports a platform layer inside a function, only
#: when the config (or the file it is given) names that layer.
BUILDERS = {
    "sit_vit5/objective/__init__.py": "objective_class imports DiT's objective for objective=ddpm "
                                      "and MeanFlow's for objective=meanflow",
    "sit_vit5/training/build.py": "REPA and FSDP2 when the config sets them",
    "sit_vit5/training/data.py": "the image-folder reader for data.kind=imagefolder and the "
                                 "latent cache for data.kind=latents",
    "sit_vit5/models/loading.py": "the diffusers DiT conversion for a diffusers DiT folder",
    "sit_vit5/models/kernels.py": "the Triton QK-norm + RoPE and tail attention once switched on "
                                  "(SIT_VIT5_FUSED_QK, SIT_VIT5_TAIL_ATTENTION; kernels.fused_qk, "
                                  "kernels.tail_attention)",
}
#: Modules that import some project modules inside functions, and why: they check their inputs before
#: the heavy imports (torch, diffusers: seconds), so that a bad flag or key is reported at once
#: (issue 41). The direction rule still holds for these imports.
DEFERRED_IMPORTS = {
    "sit_vit5/config.py": "keys, types and ranges before the model checks import torch",
    "sit_vit5/sample_spec.py": "parsing sample.py's flags needs no torch",
    "sit_vit5/cli/train.py": "the config and paths before the trainer",
    "sit_vit5/cli/sample.py": "the flags and --ckpt file before the models",
    "sit_vit5/transport/sampler.py": "diffusers' flow solvers only when a sampling_method names one",
    "sit_vit5/objective/sit.py": "diffusers' flow solvers only for a scheduler or a solver name",
    "sit_vit5/vae.py": "the hub's network probe only for a hub id (pixel space and local folders "
                       "need none)",
    **{builder: f"a builder: {why}" for builder, why in BUILDERS.items()},
}
#: Modules that import without torch (seconds to load), and why: they run before the first-minute
#: checks refuse a bad flag or key.
TORCH_FREE = {
    "sit_vit5.sample_spec": "checking the config's sample keys needs no torch",
    "sit_vit5.cli.sample_flags": "parsing sample.py's flags (and refusing bad values) needs no torch",
}
RANK = {component: rank for rank, layer in enumerate(LAYERS) for component in layer}
CLI_RANK = len(LAYERS)  # sample.py, train.py: on top of everything

#: Modules of a sit_vit5 package by layer, bottom first: the same rule one package down (the
#: package's __init__ re-exports from any of them).
PACKAGE_LAYERS: dict[str, list[tuple[str, ...]]] = {
    "utils": [
        ("errors",),
        ("checksums", "launcher", "hub_access", "precision", "cpu_threads"),
        ("atomic_files", "distributed", "run_files"),  # atomic_files writes checksum sidecars
    ],
    "training": [
        ("batching", "checkpoint", "data", "diagnostics", "ema", "fsdp", "grids", "logging",
         "step_report", "optim", "preemption"),
        ("repa",),  # all of REPA (encoders, projector, loss, its share of the step): training-only
        ("build",),
        ("loop",),
    ],
    "hub": [
        ("labels", "loader", "scheduler"),
        ("sit_pipeline",),
    ],
    "objective": [
        ("base",),  # the interface every objective implements
        ("sit", "meanflow"),
    ],
}
PACKAGE_RANK = {package: {module: rank for rank, layer in enumerate(layers) for module in layer}
                for package, layers in PACKAGE_LAYERS.items()}
PACKAGE_MODULES = [(p, m) for p, ranks in sorted(PACKAGE_RANK.items()) for m in sorted(ranks)]


def _module_name(path: Path, root: Path | None = None) -> str:
    parts = list(path.relative_to(root or ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: never executed)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            found |= {id(n) for child in node.body for n in ast.walk(child)}
    return found


def _imports(path: Path, root: Path | None = None) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module top?) for every import statement in ``path``
    that runs (not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    annotations_only = _type_checking_blocks(tree)
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # "from . import report" imports a submodule: name it
            names = [f"{module}.{a.name}" if not node.module else module for a in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in top_level) for name in names]
    return found


def _component(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "sit_vit5" and len(parts) > 1 else None


def _sources() -> list[Path]:
    return sorted((ROOT / "sit_vit5").rglob("*.py")) + [ROOT / "sample.py", ROOT / "train.py"]


def test_layer_table_names_every_component():
    on_disk = {p.stem if p.is_file() else p.name for p in (ROOT / "sit_vit5").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert on_disk == set(RANK)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_or_hidden_imports(path):
    own = _component(_module_name(path))
    own_rank = CLI_RANK if own is None else RANK[own]
    for module, line, at_top in _imports(path):
        target = _component(module)
        if target is None or target == own:
            continue
        where = f"{path.relative_to(ROOT)}:{line} imports {module}"
        if not at_top and _is_platform(module) and path.relative_to(ROOT).as_posix() in BUILDERS:
            continue  # a builder reaches up into the platform when a config asks for it
        assert RANK[target] < own_rank, f"{where}: upward or sideways edge ({own} -> {target})"
        deferred = path.relative_to(ROOT).as_posix() in DEFERRED_IMPORTS
        assert at_top or deferred, (f"{where} inside a function: project imports belong at module "
                                    "top (or in DEFERRED_IMPORTS, with the reason)")


def test_torch_free_modules_load_no_torch():
    code = f"import sys, {', '.join(TORCH_FREE)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    assert out == ["False"], f"importing {list(TORCH_FREE)} loaded torch"


def _is_platform(module: str) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in PLATFORM)


def _core_sources() -> list[Path]:
    return [p for p in sorted((ROOT / "sit_vit5").rglob("*.py"))
            if not _is_platform(_module_name(p))]


def test_the_platform_table_names_modules_that_exist():
    for module in PLATFORM:
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module
    assert set(BUILDERS) <= {p.relative_to(ROOT).as_posix() for p in _core_sources()}


@pytest.mark.parametrize("path", _core_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_platform_layer(path):
    """A core module imports a platform layer only as a builder, inside a function (a config asks)."""
    rel = path.relative_to(ROOT).as_posix()
    for module, line, at_top in _imports(path):
        if not _is_platform(module):
            continue
        assert not at_top and rel in BUILDERS, (
            f"{rel}:{line} imports the platform layer {module}: the core must not (a builder may, "
            "inside the function that reads the config; list it in BUILDERS with the reason)")


def test_the_core_check_can_fail(tmp_path, monkeypatch):
    """A planted top-level import of REPA in the loop is refused; a builder's deferred one is not."""
    fake = tmp_path / "sit_vit5" / "training"
    fake.mkdir(parents=True)
    (fake / "loop.py").write_text("from .repa import RepaTraining\n")
    (fake / "build.py").write_text("def build():\n    from .repa import RepaTraining\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    test_the_core_imports_no_platform_layer(fake / "build.py")
    with pytest.raises(AssertionError, match="platform layer sit_vit5.training.repa"):
        test_the_core_imports_no_platform_layer(fake / "loop.py")


def test_the_demo_path_loads_no_platform_module():
    """Importing what ``python train.py`` and ``sample.py grid`` run (training, the sampling pipeline,
    the SiT objective, checkpoint loading) loads no platform module."""
    code = ("import sys, sit_vit5.cli.train, sit_vit5.training, sit_vit5.sampling, sit_vit5.objective, "
            "sit_vit5.models.loading; print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    assert "sit_vit5.training.loop" in out and "sit_vit5.objective.sit" in out, out
    loaded = [m for m in out if _is_platform(m) and not m.startswith("sit_vit5.cli")]
    assert not loaded, f"the core loaded platform modules: {loaded}"


@pytest.mark.parametrize("package", sorted(PACKAGE_RANK))
def test_package_table_names_every_module(package):
    on_disk = {p.stem for p in (ROOT / "sit_vit5" / package).glob("*.py")} - {"__init__"}
    assert on_disk == set(PACKAGE_RANK[package])


@pytest.mark.parametrize(("package", "module"), PACKAGE_MODULES)
def test_package_modules_import_downwards(package, module):
    rank = PACKAGE_RANK[package]
    path = ROOT / "sit_vit5" / package / f"{module}.py"
    for imported, line, _ in _imports(path):
        parts = imported.split(".")
        if parts[:2] != ["sit_vit5", package] or len(parts) < 3:
            continue
        target = parts[2]
        assert rank[target] < rank[module], (
            f"{package}/{module}.py:{line} imports {imported}: upward or sideways edge")


def test_fid_imports_nothing_from_sit_vit5():
    paths = sorted((ROOT / "fid").rglob("*.py"))
    assert ROOT / "fid" / "__main__.py" in paths, paths
    for path in paths:
        bad = [m for m, _, _ in _imports(path) if m.split(".")[0] == "sit_vit5"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: fid/ must stay standalone"


def test_the_graph_check_can_fail(tmp_path, monkeypatch):
    """A planted upward import (config -> training) and a lazy one are both caught."""
    fake = tmp_path / "sit_vit5"
    fake.mkdir()
    (fake / "config.py").write_text("from .training import train\n\ndef f():\n    from .vae import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _imports(fake / "config.py")
    assert ("sit_vit5.training", 1, True) in found and ("sit_vit5.vae", 4, False) in found
    with pytest.raises(AssertionError, match="upward"):
        test_no_upward_or_hidden_imports(fake / "config.py")


# ----------------------------------------------------------------------------- no import cycles

#: Packages whose module graph must be acyclic (imports inside functions count: a lazy import that
#: hides a cycle is still one).
GRAPH_ROOTS = ("sit_vit5", "fid", "bench")
#: Two-module cycles allowed for now, each as a pair of modules (remove a pair once it is broken).
ALLOWED_CYCLES: set[frozenset[str]] = set()  # none: LoadedModel lives in models/checkpoint_files.py


def _resolve(module: str, known: set[str]) -> str | None:
    """The project module ``module`` names (``from pkg.mod import name`` gives ``pkg.mod.name``
    or ``pkg.mod``: the longest prefix that is a module), or None outside the project."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, over every .py file of GRAPH_ROOTS under ``root``."""
    paths = [p for r in GRAPH_ROOTS for p in sorted((root / r).rglob("*.py"))]
    modules = {_module_name(p, root): p for p in paths}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for imported, line, _ in _imports(path, root):
            target = _resolve(imported, set(modules))
            if target is not None and target != name:
                edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]],
                allowed: set[frozenset[str]] = frozenset()) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module,
    after dropping the edges between the two modules of each ``allowed`` pair (Tarjan's algorithm)."""
    edges = {a: [b for b in sorted(targets) if frozenset({a, b}) not in allowed and b in graph]
             for a, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    cycles = []
    for component in components:  # a shortest way from the first module back to it, inside the component
        members, start = set(component), component[0]
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in edges[v]:
                if w == start:
                    cycles.append([*paths[v], start])
                    queue = []
                    break
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph, ALLOWED_CYCLES)
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(
        _describe(c, graph) for c in cycles)


def test_the_cycle_check_can_fail(tmp_path):
    """A cycle hidden by a lazy import (a -> b at top, b -> a inside a function) is found, and an
    allowed pair is not."""
    fake = tmp_path / "bench"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("from bench.b import f\n")
    (fake / "b.py").write_text("def f():\n    from . import a\n")
    (fake / "c.py").write_text("import bench.a\n")
    graph = import_graph(tmp_path)
    assert graph["bench.a"] == {"bench.b": 1} and graph["bench.b"] == {"bench.a": 2}
    assert find_cycles(graph) == [["bench.a", "bench.b", "bench.a"]]
    assert find_cycles(graph, {frozenset({"bench.a", "bench.b"})}) == []
    with pytest.raises(AssertionError, match=r"bench\.a \(line 1\) -> bench\.b \(line 2\) -> bench\.a"):
        assert not find_cycles(graph), _describe(find_cycles(graph)[0], graph)
