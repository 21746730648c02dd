"""Build a markup schema from a Python function, as Prompt Cache's Python front end does:
string statements are text, `if` is a module, `if / elif / else` is a union, arguments
annotated `Param(n)` are parameters (used inside f-strings), `with user():` and friends are
chat roles. The function is read, never called.

    @schema
    def travel(duration: Param(6), coast, mountains):
        system("You plan trips.")
        with user():
            if trip_plan:
                f"Plan a trip lasting {duration}."
            if coast:
                "The destination is the coast."
            elif mountains:
                "The destination is the mountains."

    travel.xml  # '<schema name="travel">...' for PromptCache.add_schema
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from rag_kvcache.markup.language import NAME, ROLES, MarkupError


@dataclass(frozen=True)
class Param:
    """Annotation of a parameter argument: at most `length` tokens."""

    length: int


@dataclass(frozen=True)
class PythonSchema:
    name: str
    xml: str


def schema(fn: Callable[..., Any]) -> PythonSchema:
    """Decorator: the schema a function describes (see the module docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    params: dict[str, int] = {}
    for arg in func.args.args:
        note = arg.annotation
        if isinstance(note, ast.Call) and getattr(note.func, "id", "") == "Param":
            length = note.args[0] if note.args else None
            count = length.value if isinstance(length, ast.Constant) else None
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise MarkupError(f"line {note.lineno}: Param needs a token count >= 1, Param(6)")
            params[arg.arg] = count
    body = _statements(func.body, params)
    name = fn.__name__.replace("_", "-")
    return PythonSchema(name, f"<schema name={quoteattr(name)}>{body}</schema>")


def _statements(nodes: list[ast.stmt], params: dict[str, int]) -> str:
    out = []
    for node in nodes:
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.append(escape(value.value))
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.JoinedStr):
            out.append(_fstring(node.value, params))
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            role = getattr(node.value.func, "id", "")
            if role in ROLES and len(node.value.args) == 1:
                inner = _statements([ast.Expr(node.value.args[0])], params)
                out.append(f"<{role}>{inner}</{role}>")
                continue
        if isinstance(node, ast.With) and len(node.items) == 1:
            call = node.items[0].context_expr
            role = getattr(getattr(call, "func", None), "id", "")
            if role in ROLES:
                out.append(f"<{role}>{_statements(node.body, params)}</{role}>")
                continue
        if isinstance(node, ast.If):
            out.append(_conditional(node, params))
            continue
        if isinstance(node, ast.Pass):
            continue
        raise MarkupError(
            f"line {node.lineno}: a schema function holds text, f-strings, role calls, "
            f"`with user():` blocks and if / elif / else, not {type(node).__name__}"
        )
    return "\n".join(out)  # whitespace between statements: a space between their texts


def _conditional(node: ast.If, params: dict[str, int]) -> str:
    """`if a:` -> module a; `if a: ... elif b: ... else: ...` -> union of a, b, a-else."""
    branches = [(_module_name(node.test), node.body)]
    rest = node.orelse
    while len(rest) == 1 and isinstance(rest[0], ast.If):
        branches.append((_module_name(rest[0].test), rest[0].body))
        rest = rest[0].orelse
    if rest:
        branches.append((f"{branches[0][0]}-else", rest))
    modules = "\n".join(
        f"<module name={quoteattr(name)}>{_statements(body, params)}</module>"
        for name, body in branches
    )
    return modules if len(branches) == 1 else f"<union>{modules}</union>"


def _module_name(test: ast.expr) -> str:
    """The module an `if` names, refused here, at its line, if the compiler would refuse it."""
    if isinstance(test, ast.Name):
        if test.id.startswith("_"):  # (it became "-private", refused as a name of '_' first)
            raise MarkupError(
                f"line {test.lineno}: `if {test.id}:` names module "
                f"{test.id.replace('_', '-')!r} ('_' is written '-'): start it with a letter"
            )
        name = test.id.replace("_", "-")
    elif (
        isinstance(test, ast.Compare)
        and len(test.comparators) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
    ):
        name = str(test.comparators[0].value)
    else:
        name = ""
    if name in ROLES:
        raise MarkupError(f"line {test.lineno}: a module cannot be named {name!r}, like a role")
    if NAME.fullmatch(name):
        return name
    if name:
        raise MarkupError(
            f"line {test.lineno}: a module name is a letter A-Z or a-z, or '_', then letters, "
            f"digits, '_', '.' or '-' (got {name!r})"
        )
    raise MarkupError(
        f"line {test.lineno}: a module condition is a name (`if miami:`) or a comparison with a "
        'string (`if city == "miami":`)'
    )


def _fstring(node: ast.JoinedStr, params: dict[str, int]) -> str:
    out = []
    for part in node.values:
        if isinstance(part, ast.Constant):
            out.append(escape(str(part.value)))
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
            name = part.value.id
            if part.conversion != -1 or part.format_spec is not None:  # nothing could apply it
                raise MarkupError(
                    f"line {node.lineno}: {{{name}}} is filled with the argument's text as "
                    "given; a conversion (!r) or format spec (:>8) would be dropped"
                )
            if name not in params:
                raise MarkupError(f"line {node.lineno}: {{{name}}} is not a Param(n) argument")
            out.append(f'<param name={quoteattr(name)} len="{params[name]}"/>')
        else:
            raise MarkupError(f"line {node.lineno}: only {{name}} of a Param argument in f-strings")
    return "".join(out)


def system(text: str) -> None:
    """Markers for schema functions (never called: the function is only read)."""


def user(text: str | None = None) -> Any:
    """See `system`."""


def assistant(text: str | None = None) -> Any:
    """See `system`."""
