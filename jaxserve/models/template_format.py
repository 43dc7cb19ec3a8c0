"""Which form a chat template reads a message's content in: vLLM's `auto` --chat-template-content-format.

A template written for OpenAI's list of content parts loops over a message's content
(`{% for part in message['content'] %}`); given a plain text, that loop would run over its characters.
Such a template gets the parts (`openai`); any other gets the text (`string`). The template's syntax tree
is read, following the variables it sets: the messages (`{% set loop_messages = messages[1:] %}`), each
message a loop takes from them, and a message's content (`{% set content = message['content'] %}`),
through filters, tests and slices (`message['content'] | selectattr('type', 'equalto', 'text')`).
"""

import functools
from typing import Any

import jinja2
import jinja2.nodes as nodes


def _wraps(node: nodes.Node) -> bool:
    """A filter, test or slice, which reads the value under it: `x | f`, `x is string`, `x[1:]`."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)


def _key_of(node: nodes.Node, key: str) -> nodes.Node | None:
    """x, where `node` is `x[key]` or `x.key`."""
    if isinstance(node, nodes.Getitem):
        return node.node if isinstance(node.arg, nodes.Const) and node.arg.value == key else None
    return node.node if isinstance(node, nodes.Getattr) and node.attr == key else None


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its item or attribute `key`), under any wrappers."""
    while _wraps(node):
        node = node.node
    if key is not None and (node := _key_of(node, key)) is None:
        return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _with_assigned(tree: nodes.Template, names: set[str]) -> set[str]:
    """`names` and every variable `{% set %}` gives the value of one of them, transitively."""
    names = set(names)
    assigns = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    while new := {a.target.name for a in assigns if a.target.name not in names and _reads(a.node, names)}:
        names |= new
    return names


def _parse(template: str) -> nodes.Template:
    """The template's syntax tree, parsed as transformers renders it (its extensions: `{% generation %}`,
    loop controls)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: jinja's loop controls, the extension templates use most
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    return _compile_jinja_template(template).environment.parse(template)


@functools.lru_cache(maxsize=16)
def template_content_format(template: str) -> str:
    """openai where `template` loops over a message's content, else string (also for a template that does
    not parse: rendering it reports the error)."""
    try:
        tree = _parse(template)
    except Exception:  # jinja's syntax errors, and whatever else a broken template raises
        return "string"
    message_lists = _with_assigned(tree, {"messages"})
    loops = list(tree.find_all(nodes.For))
    messages = {loop.target.name for loop in loops
                if isinstance(loop.target, nodes.Name) and _reads(loop.iter, message_lists)}
    contents = _with_assigned(tree, {a.target.name for a in tree.find_all(nodes.Assign)
                                     if isinstance(a.target, nodes.Name) and _reads(a.node, messages, "content")})
    if any(_reads(loop.iter, messages, "content") or _reads(loop.iter, contents) for loop in loops):
        return "openai"
    return "string"


def rendering_template(template: str | dict[str, str] | None, tools: Any) -> str | None:
    """The template that renders a request, as transformers picks it from a tokenizer's named templates:
    `tool_use` for a request with tools where there is one, else `default`."""
    if not isinstance(template, dict):
        return template
    if tools and "tool_use" in template:
        return template["tool_use"]
    return template.get("default")


def resolve_content_format(setting: str, template: str | dict[str, str] | None, tools: Any) -> str:
    """--chat-template-content-format's `setting` (`string`, `openai` or `auto`), `auto` read from the
    template that renders a conversation with `tools`."""
    if setting != "auto":
        return setting
    rendering = rendering_template(template, tools)
    return template_content_format(rendering) if rendering else "string"


class ContentPartError(ValueError):
    """A content part that is not a text part, or a text part without a text; `where`: the part's index, and
    the field at fault within it ("2", "2.text")."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def content_texts(content: Any) -> list[str] | None:
    """A message's content as its texts: a string is one; OpenAI's list of content parts, each text part's
    text. None for anything else (no content). Raises ContentPartError for a part that is not text."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ContentPartError(f"content part of type {kind!r} is not supported; only text", str(j))
        if not isinstance(part.get("text"), str):
            raise ContentPartError("a text part's text must be a string", f"{j}.text")
        texts.append(part["text"])
    return texts


def template_content(texts: list[str], content_format: str) -> str | list[dict[str, str]]:
    """A message's texts as a template of `content_format` reads them: one text, the parts joined by
    newlines (string), or OpenAI's list of text parts (openai)."""
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)
