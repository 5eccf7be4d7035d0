"""Each manager of the scheduler holds its state privately and no other module writes it
(docs/architecture.md: what each owns, what it answers), checked from the source:

1. Private state stays in its module: `x._name` (x not `self` or `cls`) is reached only in the
   module that defines `_name` (`self._name = ...`, a field or method of a class there). The
   managers' state is private (Placement's queues, an ExecutorResidency's slots, the core's step
   builders, Merges' merge states, ...), so no other module reads it, changes it in place or
   keeps an alias of it.
2. The records that cross modules are written only by their owners: a request's progress and
   charges, the core's ExecutorState, a running sequence, a slot, a merge state. A write is an
   assignment (also augmented, or unpacked) or an in-place change (`x.f[k] = ...`, `del x.f[k]`,
   `x.f.append(...)`, ...).
3. A request is the client's frozen ask, what it was made with (never written again) and the
   core's progress: fewer than 15 fields change.
4. The scheduler's import graph has no cycle outside the steps wing (imports for type checking
   and inside functions count).
"""

import ast
import dataclasses
import pathlib

from scheduler.request import Ask, Charges, Request

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEDULER = ROOT / "scheduler"
BUILDERS = {"steps/sequence.py", "steps/step_builder.py", "steps/fast_steps.py",
            "steps/reference_steps.py", "steps/cohort.py"}
NAMING = {"steps/prefix_cache.py", "steps/longrope.py"}  # the names of a request's blocks

# Request: made with these, never written after.
REQUEST_MADE_WITH = ["serial", "ask", "output", "emit", "sink", "sink_id"]
# Request: its progress, and who writes each part.
REQUEST_PROGRESS = {
    **dict.fromkeys(["status", "arrival", "queued_since", "admitted_at", "finish_reason",
                     "executor_failures"], {"core.py"}),
    "executor": {"placement.py"},
    **dict.fromkeys(["cache_key", "base_cache_key", "runs_long", "block_hashes"], NAMING),
    **dict.fromkeys(["first_token_at", "prompt_logprobs"], {"request.py"}),
    "charges": set(),  # (its fields are Admission's)
}
OWNERS = {
    **dict.fromkeys(REQUEST_MADE_WITH, set()),
    **REQUEST_PROGRESS,
    **dict.fromkeys([f.name for f in dataclasses.fields(Charges)], {"admission.py"}),
    # ExecutorState: the core's
    **dict.fromkeys(["is_up", "is_draining", "is_leaving", "is_stopping", "steps_since_up",
                     "blocks", "rates"], {"core.py"}),
    # Sequence: the step builders'
    **dict.fromkeys(["num_computed", "num_known", "last_step", "is_sent", "capacity",
                     "max_tokens"], BUILDERS),
    **dict.fromkeys(["num_published", "publish_at"], {"steps/prefix_cache.py"}),
    **dict.fromkeys(["quiet_below", "decode_below", "decode_row"], {"steps/fast_steps.py"}),
    **dict.fromkeys(["cohort", "joined_at", "leaves_at"], {"steps/cohort.py"}),
    # Slot, Staged: the slot table's
    **dict.fromkeys(["state", "adapter", "pins", "last_used", "is_admin_pinned", "reserved_for",
                     "uses", "evicted", "is_from_staged", "pages", "evicted_pages",
                     "staged_at"], {"residency/slots.py"}),
    "is_due": {"residency/fetches.py"},  # LoadFailure
    # MergeState: Merges'
    **dict.fromkeys(["dedicated_to", "dedicated_bytes", "dedicated_ranks", "merged_slot",
                     "unmerge_due", "unmerging"], {"merging.py"}),
}
IN_PLACE = {"append", "appendleft", "extend", "insert", "pop", "popleft", "remove", "clear",
            "update", "setdefault", "add", "discard", "sort", "reverse"}


def modules() -> dict[str, ast.Module]:
    return {path.relative_to(SCHEDULER).as_posix(): ast.parse(path.read_text(), str(path))
            for path in sorted(SCHEDULER.rglob("*.py"))}


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private(tree: ast.Module) -> set[str]:
    """The private names a module defines: on `self`, and as a class's fields and methods."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_self(node.value) and \
                isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return {name for name in names if private(name)}


def reached_private(tree: ast.Module):
    """(name, line) of every `x._name` whose x is not self or cls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and not is_self(node.value):
            yield node.attr, node.lineno


def written_attributes(tree: ast.Module):
    """(attribute name, line) of every write of `x.name` whose x is not self: assigned (also
    augmented, annotated, unpacked), deleted from, or changed in place."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in IN_PLACE:
            targets = [node.func.value]  # x.f.append(...): a write of x.f
        stack = list(targets)
        while stack:
            target = stack.pop()
            if isinstance(target, ast.Tuple | ast.List):
                stack.extend(target.elts)
            elif isinstance(target, ast.Subscript):
                stack.append(target.value)  # x.f[k] = ...: a write of x.f
            elif isinstance(target, ast.Starred):
                stack.append(target.value)
            elif isinstance(target, ast.Attribute) and not is_self(target.value):
                yield target.attr, target.lineno


def test_no_module_reaches_another_modules_private_state():
    trees = modules()
    wrong = []
    for name, tree in trees.items():
        own = defined_private(tree)
        wrong += [f"scheduler/{name}:{line} reaches .{attr}, private to another module"
                  for attr, line in reached_private(tree) if attr not in own]
    assert not wrong, "\n".join(wrong)


def test_shared_records_are_written_only_by_their_owners():
    wrong = []
    for name, tree in modules().items():
        for attr, line in written_attributes(tree):
            owners = OWNERS.get(attr)
            if owners is not None and name not in owners:
                wrong.append(f"scheduler/{name}:{line} writes .{attr} (owned by "
                             f"{', '.join(sorted(owners)) or 'nobody: set when made'})")
    assert not wrong, "\n".join(wrong)


def test_a_request_is_its_frozen_ask_what_it_was_made_with_and_under_15_changing_fields():
    assert Ask.__dataclass_params__.frozen
    fields = [f.name for f in dataclasses.fields(Request)]
    assert set(fields) == set(REQUEST_MADE_WITH) | set(REQUEST_PROGRESS), \
        "every field of Request is either made with it or its progress, with its writers"
    assert len(REQUEST_PROGRESS) < 15


def test_the_checks_see_what_they_look_for():
    """(The scans must find what they look for, or the tests above could never fail.)"""
    source = ast.parse("a.b = 1\nc.d, (e.f, g) = x\nh.i += 1\nself.j = 2\nk.l[0] = 3\n"
                       "del m.n[1]\no.p.append(4)\nq.r.s.add(5)\n")
    assert {name for name, _ in written_attributes(source)} == \
        {"b", "d", "f", "i", "l", "n", "p", "s"}
    source = ast.parse("class C:\n    _field: int\n    def _m(self):\n        self._x = 1\n"
                       "        other._y[0] = 2\n        alias = part._slots\n")
    assert defined_private(source) == {"_field", "_m", "_x"}
    assert {name for name, _ in reached_private(source)} == {"_y", "_slots"}


# ---- the import graph -----------------------------------------------------------------------
def scheduler_imports() -> dict[str, set[str]]:
    """module -> the scheduler modules it imports (all of its imports, wherever they are)."""
    names = {"scheduler." + path.relative_to(SCHEDULER).with_suffix("").as_posix()
             .replace("/", ".").removesuffix(".__init__") for path in SCHEDULER.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(SCHEDULER.rglob("*.py")):
        module = ("scheduler." + path.relative_to(SCHEDULER).with_suffix("").as_posix()
                  .replace("/", ".").removesuffix(".__init__"))
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in names:
                    edges.add(node.module)
                edges |= {f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in names}
        edges.discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scheduler_imports_no_cycle_outside_the_steps_wing():
    outside = [c for c in cycles(scheduler_imports())
               if not all(m.startswith("scheduler.steps.") for m in c)]
    assert not outside, outside


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert scheduler_imports()["scheduler.core"] >= {"scheduler.placement",
                                                     "scheduler.residency.residency"}
