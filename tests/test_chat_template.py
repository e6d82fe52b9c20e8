"""A model file's chat template is untrusted code: it renders in a sandbox, and a template that
reaches for Python internals is refused with one line naming the file, before any worker starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from models.gguf_model import ChatTemplate, GGUFModel, ModelMissing, TemplateError
from tests.gguf_files import copy_with_metadata

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent

# the payload of CVE-2024-34359: reach `os` through a global's function and run a command
ESCAPE = "{{ cycler.__init__.__globals__.os.system('touch %s') }}"


@pytest.fixture(scope="module")
def packaged():
    try:
        return GGUFModel().path
    except ModelMissing as exc:
        pytest.skip(str(exc))


def test_template_escaping_the_sandbox_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    template = ChatTemplate(ESCAPE % marker, "evil.gguf")
    with pytest.raises(TemplateError, match=r"^evil\.gguf: the chat template tried an unsafe operation"):
        template.render([{"role": "user", "content": "hi"}])
    assert not marker.exists()


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",  # attribute starting with an underscore
        "{% set _ = messages.append({'role': 'x'}) %}",  # mutating the caller's list
        "{{ ''.__class__.__subclasses__() }}",
    ],
)
def test_unsafe_attributes_and_mutation_are_refused(source):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="unsafe operation"):
        ChatTemplate(source, "m.gguf").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_that_refuses_or_breaks_names_the_file():
    with pytest.raises(TemplateError, match=r"^t\.gguf: .*refused the messages: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}", "t.gguf").render([])
    with pytest.raises(TemplateError, match=r"^t\.gguf: the chat template cannot be rendered"):
        ChatTemplate("{% for %}", "t.gguf").render([])


def test_a_template_that_renders_a_lone_surrogate_is_refused_naming_the_file():
    """JSON carries a lone surrogate back from the sandbox; as text it has no UTF-8 to tokenize."""
    with pytest.raises(TemplateError, match=r"^t\.gguf: .*not UTF-8 \(a lone surrogate at character 2\)"):
        ChatTemplate("{{ 'ab\\ud800' }}", "t.gguf").render([])


def test_safe_template_renders_as_before():
    source = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) == "<user>hi<a>"


def test_generate_with_a_malicious_gguf_fails_in_one_line_and_runs_nothing(packaged, tmp_path):
    marker = tmp_path / "pwned"
    evil = copy_with_metadata(packaged, tmp_path / "evil.gguf", {"tokenizer.chat_template": ESCAPE % marker})
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", "hi", "--chat", "--model", str(evil)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(evil) in lines[0] and "unsafe operation" in lines[0], out.stderr
    assert "workers started" not in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "source, says",
    [
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ (9 + 9) ** (10 ** 9) }}", "longer than"),
        ("{{ lipsum(n=2000000) }}", "longer than"),
        ("{{ 'x' * 2000000000 }}", "memory"),
        ("{{ '{:>1500000000}'.format('x') }}", "memory"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "recursed"),
        ("{{ range(10 ** 9) | list }}", ""),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ],
)
def test_a_template_that_runs_too_long_or_too_large_is_stopped_in_one_line(source, says):
    """Each ends within the time limit and the child's memory limit, as a one-line TemplateError;
    the next template renders as usual (a child killed at its time limit is started again)."""
    import time

    from models.template_sandbox import TIME_LIMIT

    start = time.monotonic()
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source, "heavy.gguf").render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < TIME_LIMIT + 1.5
    assert "\n" not in str(caught.value) and says in str(caught.value) and "heavy.gguf" in str(caught.value)
    assert ChatTemplate("{{ messages[0]['content'] }}").render([{"role": "user", "content": "ok"}]) == "ok"


def test_serve_answers_a_runaway_template_with_400(tmp_path):
    """The server's chat endpoint turns a stopped template into an OpenAI 400 (not a 500, not a
    hung request): checked on the app with a batcher that never runs."""
    import types

    from fastapi.testclient import TestClient

    from models.openai_server import build_app

    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab=10), longest_token_bytes=1)
    batcher = types.SimpleNamespace(tokenizer=None, model=model, ctx=64, lost="", slots=[None], active=lambda: 0)
    app = build_app(batcher, "m", chat_template=ChatTemplate("{{ 'x' * 2000000000 }}", "heavy.gguf"))
    reply = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and "memory" in reply.json()["error"]["message"]


# The families' own templates (as their tokenizer_config.json ships them), each with the text its
# model card documents for a conversation, worked out by hand from that format.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize(
    "source, bos, eos, expected",
    [
        (
            CHATML,
            "",
            "<|im_end|>",
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
        ),
        (MISTRAL, "<s>", "</s>", "[INST] Hi [/INST]Hello</s> [INST] Bye [/INST]"),
        (
            LLAMA3,
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            "Hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
    ids=["qwen-chatml", "mistral-inst", "llama3"],
)
def test_the_families_templates_render_their_documented_format(source, bos, eos, expected):
    """With the vocabulary's BOS and EOS texts; the BOS the template writes first is dropped where
    the tokenizer adds it (llama.cpp's rule: one BOS), the EOS between turns kept."""
    template = ChatTemplate(source, "family.gguf", bos, eos, strip_bos=True)
    assert template.render(TURNS) == expected


# Gemma's turn format as its model card documents it (written here from that format): no system
# role, a system message folded into the first user turn, the assistant's turns under "model",
# roles that do not alternate refused
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_a_gemma_style_template_folds_the_system_message_and_refuses_turns_out_of_order():
    """What Gemma's template asks of the sandbox: a slice of the messages, names set inside a
    branch, a conditional expression, the trim filter and raise_exception. The BOS it writes is
    dropped where the tokenizer adds one (Gemma's does)."""
    template = ChatTemplate(GEMMA, "gemma.gguf", "<bos>", "<eos>", strip_bos=True)
    system = [{"role": "system", "content": "Be brief. "}]
    assert template.render(system + TURNS) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert template.render(TURNS[:1]) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(TemplateError, match=r"^gemma\.gguf: .*refused the messages: roles must alternate"):
        template.render([TURNS[0], TURNS[0]])


def test_a_mistral_conversation_tokenizes_with_one_bos_and_its_turns_eos():
    """Through Llama 2's SentencePiece vocabulary (llama.cpp's file): BOS once, at the start,
    and </s> after the assistant's turn, parsed as the control token it is."""
    from pathlib import Path

    from models.gguf_model import GGUFModel

    vocab = GGUFModel(Path(__file__).parent / "data" / "ggml-vocab-llama-spm.gguf", vocabulary_only=True)
    tokenizer = vocab.tokenizer
    text = ChatTemplate(MISTRAL, "mistral.gguf", "<s>", "</s>", strip_bos=tokenizer.add_bos).render(TURNS)
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1
    # llama.cpp's SentencePiece rule: text after a special token gets the prefix space too
    assert tokenizer.decode(ids, skip_special=True) == " [INST] Hi [/INST]Hello  [INST] Bye [/INST]"


def test_a_template_that_dates_its_system_message_renders():
    """Llama 3.1's and 3.2's templates call strftime_now when it is defined."""
    source = "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% endif %}|{{ messages[0]['content'] }}"
    year, rest = ChatTemplate(source).render(TURNS).split("|")
    assert year.isdigit() and len(year) == 4 and rest == "Hi"


def test_a_renderer_that_died_between_renders_is_started_again():
    """The sandbox child killed while idle (the OOM killer, an operator): the next render starts a
    new one rather than failing on the dead one's pipe."""
    import signal

    from models.template_sandbox import renderer

    template = ChatTemplate("{{ messages[0]['content'] }}!", "t.gguf")
    assert template.render([{"role": "user", "content": "one"}]) == "one!"
    child = renderer()._child
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert template.render([{"role": "user", "content": "two"}]) == "two!"


def test_bos_is_taken_off_only_where_the_rendered_text_starts_with_it():
    """With the tokenizer adding BOS itself, a template that writes it loses it (one BOS, as
    llama.cpp); a text that does not start with it keeps every character, a BOS later in it too."""
    source = "{{ messages[0]['content'] }}"
    strip = dict(bos_token="<s>", strip_bos=True)
    assert ChatTemplate(source, "t.gguf", **strip).render([{"role": "user", "content": "<s>hi"}]) == "hi"
    assert ChatTemplate(source, "t.gguf", **strip).render([{"role": "user", "content": "s>hi<s>"}]) == "s>hi<s>"
    assert ChatTemplate(source, "t.gguf", bos_token="<s>").render([{"role": "user", "content": "<s>hi"}]) == "<s>hi"


# a thinking switch in the style of Qwen3's: the generation prompt closes an empty thought where
# the caller turns thinking off
THINKING = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)


def test_a_templates_further_variables_are_given_and_its_own_cannot_be_replaced():
    hi = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(THINKING).render(hi) == "<user>hi<assistant>"
    assert ChatTemplate(THINKING).render(hi, variables={"enable_thinking": True}) == "<user>hi<assistant>"
    off = ChatTemplate(THINKING).render(hi, variables={"enable_thinking": False})
    assert off == "<user>hi<assistant><think></think>"
    for bad, says in (({"messages": []}, "the template's own messages"), ({"a-b": 1}, "variable names")):
        with pytest.raises(TemplateError, match=says):
            ChatTemplate(THINKING, "t.gguf").render(hi, variables=bad)


def test_generate_gives_the_chat_template_kwargs_to_the_template(packaged, tmp_path):
    """`launch.py generate --chat-template-kwargs` (llama-server's flag): the prompt the model
    reads is the template's with the variables (two tokens of '<think></think>' more here);
    JSON that is not an object of names is one line."""
    import json

    path = copy_with_metadata(packaged, tmp_path / "thinking.gguf", {"tokenizer.chat_template": THINKING})

    def prompt_tokens(*flags: str) -> int:
        args = ("generate", "-m", str(path), "hi", "-n", "1", "--workers", "1", "--json", "-", *flags)
        done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return len(json.loads(done.stdout.decode().splitlines()[-1])["prompt_tokens"])

    on = prompt_tokens("--chat")
    off = prompt_tokens("--chat-template-kwargs", '{"enable_thinking": false}')
    assert off > on
    refused = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", "-m", str(path), "hi", "--chat-template-kwargs", "[1]"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].endswith("must be an object whose keys are variable names")
