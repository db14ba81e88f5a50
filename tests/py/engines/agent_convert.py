#!/usr/bin/env python3
"""Runs vLLM 0.33.0's own Responses API and Anthropic Messages API conversions, unmodified: the
code that turns a /v1/responses or /v1/messages request into the chat messages and tools the
chat template renders. The files fetch.py extracts, imported behind the stand-ins in shims/.

    agent_convert.py < cases.jsonl > results.jsonl

The engine sources are found in $KVLB_ENGINE_SRC (fetch.py's output); without it, fetch.py is
run first.

Each input line is one case, answered by one output line, in order:

    {"name": "...", "api": "responses", "body": {...},
     "previous": {"messages": [...], "output": [...]}}          (previous: optional)
        The body is validated as vLLM's API layer does (ResponsesRequest.model_validate), then
        converted as OnlineRenderer.render_responses does without Harmony:
        construct_tool_dicts(tools, tool_choice) (--exclude-tools-when-tool-choice-none off, the
        default) and construct_input_messages(instructions, input, previous messages, previous
        output). A previous turn (previous_response_id) is the chat messages vLLM stored for it
        and its response's output items, validated as ResponseOutputItem as in the stored
        response.

    {"name": "...", "api": "messages", "body": {...}, "merge_inline_system": false}
        AnthropicMessagesRequest.model_validate, then the classmethod
        AnthropicServingMessages.to_chat_completion_request(request, merge_inline_system=...),
        which builds and validates a ChatCompletionRequest. (vLLM decides merge_inline_system
        once per server from its chat template; here the case says.)

    {"name": "...", "api": "template", "body": {...}}
        A chat completions body as the template stage would take it: vLLM's chat parser on its
        messages as they are, and the template variables ChatCompletionRequest.build_chat_params
        makes of its add_generation_prompt, continue_final_message, documents, reasoning_effort
        and chat_template_kwargs. (A chat body's messages may hold what vLLM hands the parser
        on the Responses path, such as input_text parts, which a ChatCompletionRequest would
        refuse.) Answered with chat_template_kwargs and conversation only.

Answers:

    {"name": ..., "ok": true, "messages": [...], "tools": [...] | null, "tool_choice": ...,
     "chat_template_kwargs": {...}, "conversation": {"string": ..., "openai": ...}}
        messages: the chat messages handed to the chat template stage (preprocess_chat), as JSON
        (an iterable vLLM keeps unconsumed, e.g. a validated content list, as a list);
        conversation: what vLLM's chat parser (parse_chat_messages, the real chat_message.py)
        makes of those messages for the template, in each content format a template can be
        detected as ("string": content parts joined into text; "openai": content as a list of
        parts), as {"ok": true, "messages": [...]} or {"ok": false, "error": ...}. Media parts
        are counted, not fetched, and stand for placeholders such as `<image>`
        (shims/vllm/renderers/chat_utils/item_tracker.py);
        tools: the tool dicts the template gets (None: no `tools` variable);
        tool_choice: the chat request's tool_choice ("messages" only);
        chat_template_kwargs: the request's build_chat_params(...).chat_template_kwargs: what
        the request adds to the template's variables (add_generation_prompt,
        continue_final_message, reasoning_effort, enable_thinking, documents, the request's
        own chat_template_kwargs), before the server's defaults.
    {"name": ..., "ok": false, "error": "ExceptionType: message"}
        vLLM rejected the request (validation or conversion).
"""

import copy
import json
import os
import sys
import traceback
import types
from collections.abc import Iterable

from driver import ENGINE_DIRS, SHIMS, engine_src

# Real vLLM modules (from the fetched sources) and the stand-ins they need (from shims/).
REAL = [
    "vllm.envs",
    "vllm.exceptions",
    "vllm.logprobs",
    "vllm.renderers.params",
    "vllm.renderers.chat_utils.types",
    "vllm.renderers.chat_utils.tool_call",
    "vllm.renderers.chat_utils.chat_message",
    "vllm.renderers.chat_utils.content_parser",
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.generate.base.protocol",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.responses.protocol",
    "vllm.entrypoints.openai.responses.utils",
    "vllm.tool_parsers.utils",
    "vllm.entrypoints.anthropic.protocol",
    "vllm.entrypoints.anthropic.serving",
]
SHIMMED = [
    "fastapi",
    "torch",
    "vllm.logger",
    "vllm.utils",
    "vllm.utils.import_utils",
    "vllm.config",
    "vllm.sampling_params",
    "vllm.outputs",
    "vllm.inputs",
    "vllm.tokenizers",
    "vllm.multimodal.media",
    "vllm.multimodal.media.connector",
    "vllm.renderers",
    "vllm.renderers.embed_utils",
    "vllm.renderers.chat_utils",
    "vllm.renderers.chat_utils.item_tracker",
    "vllm.renderers.hf",
    "vllm.renderers.online_renderer",
    "vllm.renderers.inputs.preprocess",
    "vllm.engine.protocol",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.models.serving",
    "vllm.entrypoints.serve.exception_handling.utils",
    "vllm.entrypoints.serve.utils.request_logger",
]


# The content formats of vLLM's chat parser ("auto" resolves to one of them per template).
CONTENT_FORMATS = ("string", "openai")
# The keys of a chat completions body that ChatCompletionRequest.build_chat_params turns into
# template variables.
TEMPLATE_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "chat_template_kwargs",
)


def import_vllm():
    """Put the shims and vLLM's sources on sys.path; check each module comes from where it
    should. Returns the modules by name."""
    root = os.path.join(engine_src(), ENGINE_DIRS["vllm"])
    if not os.path.isdir(root):
        raise SystemExit(f"agent_convert.py: no {root}: run tests/py/engines/fetch.py")
    for name in REAL:
        file = os.path.join(root, *name.split(".")) + ".py"
        if not os.path.exists(file):
            raise SystemExit(
                f"agent_convert.py: no {file}: the sources predate this driver, run "
                "tests/py/engines/fetch.py again"
            )
    for path in (root, SHIMS):
        if path not in sys.path:
            sys.path.insert(0, path)
    import importlib

    modules = {}
    for name in REAL + SHIMMED:
        module = importlib.import_module(name)
        want = root if name in REAL else SHIMS
        if not os.path.abspath(module.__file__).startswith(want + os.sep):
            raise SystemExit(f"agent_convert.py: {name} came from {module.__file__}, not {want}")
        modules[name] = module
    return modules


def jsonable(value):
    """The JSON a message holds. Validated TypedDicts are dicts; a field typed Iterable is left
    by pydantic as a one-shot iterator, which the template stage consumes once: a list here."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if hasattr(value, "model_dump"):
        return jsonable(value.model_dump())
    if isinstance(value, Iterable):
        return [jsonable(v) for v in value]
    raise TypeError(f"no JSON for {type(value).__name__}: {value!r}")


class Converter:
    def __init__(self, modules):
        self.responses_protocol = modules["vllm.entrypoints.openai.responses.protocol"]
        self.responses_utils = modules["vllm.entrypoints.openai.responses.utils"]
        self.chat_protocol = modules["vllm.entrypoints.openai.chat_completion.protocol"]
        self.anthropic_protocol = modules["vllm.entrypoints.anthropic.protocol"]
        self.anthropic_serving = modules["vllm.entrypoints.anthropic.serving"]
        self.chat_message = modules["vllm.renderers.chat_utils.chat_message"]
        from openai.types.responses import ResponseOutputItem
        from pydantic import TypeAdapter

        self.output_item = TypeAdapter(ResponseOutputItem)
        # What parse_chat_messages reads of the model: a text model without prompt embeds.
        self.model_config = types.SimpleNamespace(
            enable_prompt_embeds=False, multimodal_config=None
        )

    def conversation(self, messages):
        """vLLM's chat parser (parse_chat_messages, as preprocess_chat runs it) on `messages`,
        in both content formats a chat template can be detected as: the conversation the
        template renders."""
        out = {}
        for content_format in CONTENT_FORMATS:
            try:
                conversation, _, _ = self.chat_message.parse_chat_messages(
                    copy.deepcopy(messages), self.model_config, content_format
                )
                out[content_format] = {"ok": True, "messages": jsonable(conversation)}
            except Exception as e:
                out[content_format] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return out

    def responses(self, case):
        request = self.responses_protocol.ResponsesRequest.model_validate(case["body"])
        prev_msg = prev_output = None
        previous = case.get("previous")
        if previous is not None:
            prev_msg = copy.deepcopy(previous.get("messages", []))
            prev_output = [
                self.output_item.validate_python(item) for item in previous.get("output", [])
            ]
        utils = self.responses_utils
        tools = utils.construct_tool_dicts(
            request.tools, request.tool_choice, exclude_tools_when_tool_choice_none=False
        )
        messages = jsonable(
            utils.construct_input_messages(
                request_instructions=request.instructions,
                request_input=request.input,
                prev_msg=prev_msg,
                prev_response_output=prev_output,
            )
        )
        params = request.build_chat_params(None, "auto")
        return {
            "messages": messages,
            "tools": jsonable(tools),
            "chat_template_kwargs": jsonable(params.chat_template_kwargs),
            "conversation": self.conversation(messages),
        }

    def messages(self, case):
        request = self.anthropic_protocol.AnthropicMessagesRequest.model_validate(case["body"])
        serving = self.anthropic_serving.AnthropicServingMessages
        chat = serving.to_chat_completion_request(
            request, merge_inline_system=bool(case.get("merge_inline_system", False))
        )
        return self.chat_answer(chat)

    def template(self, case):
        body = case["body"]
        messages = jsonable(body.get("messages"))
        # The template variables come from the body's other keys; a placeholder conversation
        # keeps the request valid whatever the messages hold.
        keys = {k: v for k, v in body.items() if k in TEMPLATE_KEYS}
        chat = self.chat_protocol.ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "."}], **keys}
        )
        params = chat.build_chat_params(None, "auto")
        return {
            "chat_template_kwargs": jsonable(params.chat_template_kwargs),
            "conversation": self.conversation(messages),
        }

    def render(self, case):
        """The prompt vLLM renders for a chat completions body with `case["template"]`: vLLM's
        chat parser ("string" content format), the template variables of build_chat_params
        over the request's tools, and transformers' apply_chat_template (its Jinja environment
        and continue_final_message cut), with jinja2."""
        body = case["body"]
        messages = jsonable(body.get("messages"))
        keys = {k: v for k, v in body.items() if k in TEMPLATE_KEYS}
        chat = self.chat_protocol.ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "."}], **keys}
        )
        params = chat.build_chat_params(None, "auto")
        # Each tool as the chat path validates and dumps it (an empty list, which the chat
        # path refuses, is what the Responses path renders when no tool is a function).
        tool_param = self.chat_protocol.ChatCompletionToolsParam
        tools = body.get("tools")
        if tools is not None:
            tools = [tool_param.model_validate(tool).model_dump() for tool in tools]
        # OnlineRenderer.preprocess_chat's defaults under the request's kwargs.
        kwargs = {"tools": tools, "tokenize": False} if tools is not None else {"tokenize": False}
        kwargs |= {k: v for k, v in params.chat_template_kwargs.items() if v not in (None, "auto")}
        conversation, _, _ = self.chat_message.parse_chat_messages(
            copy.deepcopy(messages), self.model_config, "string"
        )
        template = case["template"]
        if any(m["role"] == "developer" for m in conversation) and not (
            '"developer"' in template or "'developer'" in template
        ):
            conversation = developer_to_system(conversation)
        return {"prompt": render_like_transformers(template, conversation, case["special_tokens"], kwargs)}

    def chat_answer(self, chat):
        # OnlineRenderer.render_chat: the tool dicts of the chat path (the
        # tool_choice == "none" exclusion is a server flag, off by default).
        tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
        messages = jsonable(chat.messages)
        params = chat.build_chat_params(None, "auto")
        return {
            "messages": messages,
            "tools": jsonable(tools),
            "tool_choice": jsonable(chat.tool_choice),
            "chat_template_kwargs": jsonable(params.chat_template_kwargs),
            "conversation": self.conversation(messages),
        }


def developer_to_system(conversation):
    """vLLM's renderers/hf.py _convert_developer_to_system and _consolidate_system_messages
    (hf.py is not imported here: it needs transformers)."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = dict(msg)
            msg["role"] = "system"
            msg.pop("tools", None)
        converted.append(msg)
    system_contents, non_system, needs = [], [], False
    for i, msg in enumerate(converted):
        if msg["role"] == "system":
            if i > 0 or system_contents:
                needs = True
            content = msg.get("content", "")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, dict) and "text" in part:
                        parts.append(part["text"])
                    elif isinstance(part, str):
                        parts.append(part)
                content = "\n".join(parts)
            if content:
                system_contents.append(content)
        else:
            non_system.append(msg)
    if not needs:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_contents)}, *non_system]


def render_like_transformers(template, conversation, special_tokens, kwargs):
    """transformers 5's apply_chat_template(tokenize=False) and render_jinja_template: the
    special tokens under the keyword arguments, its Jinja environment, and the
    continue_final_message tag and cut."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    kwargs = dict(kwargs)
    named = {}
    for key in ("tools", "documents", "add_generation_prompt", "continue_final_message"):
        named[key] = kwargs.pop(key, None)
    kwargs.pop("tokenize", None)
    template_kwargs = {**special_tokens, **kwargs}
    chat = copy.deepcopy(conversation)
    tag = "CONTINUE_FINAL_MESSAGE_TAG "
    final = None
    if named["continue_final_message"]:
        if named["add_generation_prompt"]:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        final = chat[-1].get("content")
        if final is None or "content" not in template:
            raise ValueError("continue_final_message: no content to continue")
        chat[-1]["content"] = final + tag
    rendered = compiled.render(
        messages=chat,
        tools=named["tools"],
        documents=named["documents"],
        add_generation_prompt=bool(named["add_generation_prompt"]),
        **template_kwargs,
    )
    if final is not None:
        if final.strip() not in rendered or tag.strip() not in rendered:
            raise ValueError("continue_final_message: the final message is not in the prompt")
        at = rendered.rindex(tag.strip())
        if rendered[at : at + len(tag)] == tag:
            rendered = rendered[:at]
        else:
            rendered = rendered[:at].rstrip()
    return rendered


def main():
    converter = Converter(import_vllm())
    apis = {
        "responses": converter.responses,
        "messages": converter.messages,
        "template": converter.template,
        "render": converter.render,
    }
    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        answer = {"name": case.get("name")}
        try:
            convert = apis[case["api"]]
        except KeyError:
            raise SystemExit(f"agent_convert.py: unknown api in {line.strip()}")
        try:
            answer.update(ok=True, **convert(case))
        except Exception as e:  # vLLM's API layer answers any of these with an error
            answer.update(ok=False, error=f"{type(e).__name__}: {e}")
            if os.environ.get("KVLB_AGENT_TRACE"):
                traceback.print_exc()
        sys.stdout.write(json.dumps(answer, ensure_ascii=False) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
