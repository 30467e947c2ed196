"""The C kernel sources' structure (inference/kernels/csrc/): the file-level graph of who calls
whom (or reads whose global) has no cycle, each cross-file name is declared in kernels.h in
the section of the file that defines it, and the libraries built on their own (amx.c with
amx_int4.c, int8_vnni.c, int4.c) reach into none of the main library's files. Parsed from the text: no compiler.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

CSRC = Path(__file__).parents[2] / "inference" / "kernels" / "csrc"
SEPARATE = ("amx.c", "amx_int4.c", "int8_vnni.c", "int4.c")  # built as libraries of their own
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def kernel_sources() -> tuple[str, ...]:
    """cpu.py's KERNEL_SOURCES, read from its text (importing it would load torch)."""
    tree = ast.parse((CSRC.parent / "cpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "KERNEL_SOURCES" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("cpu.py has no KERNEL_SOURCES")


def strip(text: str) -> str:
    """C text without comments, string and character literals, or preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)
    return re.sub(r"^[ \t]*#[^\n]*(?:\\\n[^\n]*)*", " ", text, flags=re.MULTILINE)


def _callee(head: str) -> str | None:
    """The name declared by a top-level head ending in a parameter list (`... name(...)`),
    else None."""
    head = head.rstrip()
    if not head.endswith(")"):
        return None
    depth = 0
    for i in range(len(head) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(head[i], 0)
        if depth == 0:
            m = re.search(r"([A-Za-z_]\w*)\s*$", head[:i])
            return m.group(1) if m else None
    return None


def top_level(text: str) -> list[tuple[str, str]]:
    """The top-level items of stripped C text: ("function", name) for each definition,
    ("prototype", name), ("variable", name) for globals, ("extern", name) for declared
    globals, ("static", name) for file-local functions and variables."""
    items: list[tuple[str, str]] = []
    head, i, n = "", 0, len(text)
    while i < n:
        c = text[i]
        if c == "{":
            depth, j = 1, i + 1
            while depth and j < n:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            name = _callee(head)
            if name and "=" not in head:  # a function's body
                items.append(("static" if re.search(r"\bstatic\b", head) else "function", name))
                head = ""
            else:  # a struct, enum or initializer: the declaration goes on to its ';'
                head += " {} "
            i = j
            continue
        if c == ";":
            decl = head.strip()
            head = ""
            i += 1
            if (
                not decl
                or re.match(r"typedef\b", decl)
                or re.fullmatch(r"(struct|enum|union)\b[^=]*", decl)
            ):
                continue
            name = _callee(decl)
            if name and "=" not in decl:
                items.append(("static" if re.search(r"\bstatic\b", decl) else "prototype", name))
                continue
            kind = (
                "static"
                if re.search(r"\bstatic\b", decl)
                else "extern"
                if re.search(r"\bextern\b", decl)
                else "variable"
            )
            for part in _split_commas(decl):
                m = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*$", part.split("=")[0])
                if m:
                    items.append((kind, m.group(1)))
            continue
        head += c
        i += 1
    return items


def _split_commas(decl: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for c in decl:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return [*parts, cur]


def file_graph(
    sources: dict[str, str],
) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]]]:
    """For C sources {file: text}: each file's globals (functions and variables other files may
    use), and edges[a][b] = the names of b's globals that a uses."""
    stripped = {f: strip(t) for f, t in sources.items()}
    items = {f: top_level(t) for f, t in stripped.items()}
    defs = {
        f: {name for kind, name in its if kind in ("function", "variable")}
        for f, its in items.items()
    }
    owner: dict[str, str] = {}
    for f, names in defs.items():
        for name in names:
            assert name not in owner, f"{name} defined in both {owner[name]} and {f}"
            owner[name] = f
    edges: dict[str, dict[str, set[str]]] = {f: {} for f in sources}
    for f, text in stripped.items():
        local = defs[f] | {name for kind, name in items[f] if kind == "static"}
        for name in set(_IDENT.findall(text)) - local:
            if name in owner:
                edges[f].setdefault(owner[name], set()).add(name)
    return defs, edges


def find_cycle(edges: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """A cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(f: str) -> list[str] | None:
        state[f] = 1
        path.append(f)
        for g in sorted(edges.get(f, {})):
            if state.get(g) == 1:
                return [*path[path.index(g) :], g]
            if g not in state and (cycle := visit(g)):
                return cycle
        path.pop()
        state[f] = 2
        return None

    for f in sorted(edges):
        if f not in state and (cycle := visit(f)):
            return cycle
    return None


def header_sections(text: str) -> dict[str, set[str]]:
    """kernels.h's declarations (prototypes and extern globals) by the file whose section holds
    them (a comment line opening with the file's name starts its section); "" before any."""
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        m = re.match(r"/\*\s*(?:=+\s*)?(\w+\.c)\b", line)
        if m:
            current = m.group(1)
            sections.setdefault(current, [])
        sections[current].append(line)
    return {
        f: {
            name
            for kind, name in top_level(strip("\n".join(lines)))
            if kind in ("prototype", "extern")
        }
        for f, lines in sections.items()
    }


@pytest.fixture(scope="module")
def library():
    names = kernel_sources()
    return names, {f: (CSRC / f).read_text() for f in names}


def test_kernel_sources_are_all_built():
    on_disk = {p.name for p in CSRC.glob("*.c")}
    assert set(kernel_sources()) | set(SEPARATE) == on_disk


def test_file_graph_has_no_cycle(library):
    _, sources = library
    defs, edges = file_graph(sources)
    assert find_cycle(edges) is None, (
        f"cycle between kernel sources: {' -> '.join(find_cycle(edges))}"
    )
    # the parse sees the graph (not an empty one that passes trivially)
    assert {
        "ms_linear",
        "block_gemm",
        "wblock_gemm",
        "hadamard_rotate",
        "amx_block",
    } <= set().union(*defs.values())
    assert (
        "hooks.c" in edges["region.c"]
        and "hooks.c" in edges["gemm.c"]
        and "hooks.c" in edges["gemm8.c"]
    )
    assert {"gemm.c", "gemm8.c"} <= set(edges["wmat.c"])
    assert {"linear.c", "moe.c", "attention.c", "norm_rope.c"} <= set(edges["layer.c"])
    assert "gemm8.c" not in edges["gemm.c"] and "gemm.c" not in edges["region.c"]
    assert not edges["hooks.c"], "hooks.c, which everything may call, calls nothing"


def test_cross_file_names_are_declared_in_their_files_section(library):
    names, sources = library
    defs, edges = file_graph(sources)
    sections = header_sections((CSRC / "kernels.h").read_text())
    assert not sections[""], f"declarations before any file's section: {sections['']}"
    for f, declared in sections.items():
        if f:
            assert f in names, f"kernels.h has a section for {f}, not a kernel source"
            assert declared <= defs[f], (
                f"kernels.h's {f} section declares {declared - defs[f]}, defined elsewhere"
            )
    for f, out in edges.items():
        for g, used in out.items():
            assert used <= sections.get(g, set()), (
                f"{f} uses {used - sections.get(g, set())} of {g}, not in its section"
            )


def test_separate_libraries_reach_into_no_kernel_source(library):
    _, sources = library
    for lib in SEPARATE:
        _, edges = file_graph({**sources, lib: (CSRC / lib).read_text()})
        assert not edges[lib], f"{lib} uses {edges[lib]}"


def test_the_checker_finds_cycles():
    sources = {
        "a.c": "int shared;\nvoid f(void) { g(); }\n",
        "b.c": "static int f2(void) { return 0; }\nvoid g(void) { h(); }\n",
        "c.c": "void h(void) { shared = 1; }\nstatic void (*hook)(void);\n",
    }
    defs, edges = file_graph(sources)
    assert defs == {"a.c": {"shared", "f"}, "b.c": {"g"}, "c.c": {"h"}}
    assert find_cycle(edges) == ["a.c", "b.c", "c.c", "a.c"]
    sources["c.c"] = "void h(void) { int shared = 1; (void)shared; }\n"  # a local of the same name:
    _, edges = file_graph(sources)  # conservatively still an edge
    assert find_cycle(edges) is not None
    sources["c.c"] = "void h(void) {}\n"
    _, edges = file_graph(sources)
    assert find_cycle(edges) is None and edges == {
        "a.c": {"b.c": {"g"}},
        "b.c": {"c.c": {"h"}},
        "c.c": {},
    }
