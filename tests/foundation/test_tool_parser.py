"""qwen-code against compose's parsers: a completion in the model's tool-call
format (Qwen3-Coder XML) goes through the parser compose names and comes back
as an OpenAI tool call; <think> goes to reasoning."""

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def compose_flag(name):
    cmd = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["vllm"]["command"]
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(specials + ["[UNK]"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", additional_special_tokens=specials)


def request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model="qwen3.8-flash-next", messages=[{"role": "user", "content": "read main.py"}],
        tools=[{"type": "function", "function": {
            "name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {
                "absolute_path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["absolute_path"]}}}])


def test_tool_call_parser_extracts_call(tokenizer):
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(compose_flag("--tool-call-parser"))(tokenizer)
    out = ("I'll read it.\n<tool_call>\n<function=read_file>\n<parameter=absolute_path>\n/src/main.py\n"
           "</parameter>\n<parameter=limit>\n200\n</parameter>\n</function>\n</tool_call>")
    r = parser.extract_tool_calls(out, request())
    assert r.tools_called
    assert len(r.tool_calls) == 1
    call = r.tool_calls[0].function
    assert call.name == "read_file"
    assert json.loads(call.arguments) == {"absolute_path": "/src/main.py", "limit": 200}
    assert r.content.strip() == "I'll read it."


def test_plain_text_is_not_a_tool_call(tokenizer):
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(compose_flag("--tool-call-parser"))(tokenizer)
    r = parser.extract_tool_calls("No tools needed.", request())
    assert not r.tools_called and r.content == "No tools needed."


def test_reasoning_parser_splits_think(tokenizer):
    from vllm.reasoning import ReasoningParserManager

    rp = ReasoningParserManager.get_reasoning_parser(compose_flag("--reasoning-parser"))(tokenizer)
    assert rp.extract_reasoning("<think>plan the edit</think>Done.", request()) == ("plan the edit", "Done.")
