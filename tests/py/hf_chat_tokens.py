"""Renders chat bodies as transformers' apply_chat_template does (jinja2 sandbox,
trim_blocks, lstrip_blocks, loopcontrols, its tojson and raise_exception) and encodes them with
the Python `tokenizers` package: the reference kvlb's token mode is checked against.

usage: hf_chat_tokens.py TOKENIZER_JSON TOKENIZER_CONFIG_JSON < bodies (one JSON per line)
prints one JSON list of token ids per line.
"""
import json
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def main():
    tokenizer = Tokenizer.from_file(sys.argv[1])
    with open(sys.argv[2]) as f:
        config = json.load(f)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(config["chat_template"])
    for line in sys.stdin:
        body = json.loads(line)
        text = template.render(messages=body["messages"], tools=body.get("tools"),
                               add_generation_prompt=body.get("add_generation_prompt", True),
                               bos_token=config.get("bos_token") or "",
                               eos_token=config.get("eos_token") or "")
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        print(json.dumps(ids), flush=True)


if __name__ == "__main__":
    main()
