"""The model's own tokenizer and chat template (``HFChatTokenizer``), on a real Hugging Face fast
tokenizer built here from a word list (nothing downloaded) with a ChatML template: an episode's
context, built one piece at a time, is token for token what the template renders for the whole chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo
from mixrl.rl.environments.base import Message
from mixrl.rl.environments.filetree import FileTreeEnvironment, generate_tasks
from mixrl.rl.rollout.agent import run_episode
from mixrl.rl.rollout.chat_tokenizer import HFChatTokenizer, load_chat_tokenizer
from mixrl.rl.rollout.tokenizer import Tokenizer

CHATML = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16, top_logprobs_num=0, return_sampling_mask=False
)


def hf_tokenizer(template: str | None = CHATML) -> PreTrainedTokenizerFast:
    words = [*SPECIAL, " ", "\n", "system", "user", "assistant", "tool", "tools:", "probe", "question", "reply",
             *Tokenizer.filetree().tokens[8:]]  # fmt: skip
    raw = RawTokenizer(
        models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>")
    )
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"\.[a-z]+"), behavior="isolated"),
        ]
    )
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[2:],
    )
    hf.chat_template = template
    return hf


class Replies:
    """Stand-in ``generate``: the next reply of a script, encoded by the HF tokenizer."""

    def __init__(self, tokenizer: HFChatTokenizer, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.turn = 0

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        text = self.texts[self.turn]
        self.turn += 1
        ids = [*self.tokenizer.hf.encode(text, add_special_tokens=False), self.tokenizer.end_id]
        records = [TokenRecord(token_id=t, logprob=-0.1, weight_version=0) for t in ids]
        return GenerateResult(records, "stop", PoolInfo("scripted", "cpu", "bf16"))


def test_the_end_of_turn_and_stop_tokens_come_from_the_template() -> None:
    tokenizer = HFChatTokenizer(hf_tokenizer())
    im_end, eos = (tokenizer.hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert tokenizer.end_id == im_end and tokenizer.stop_token_ids == [im_end, eos]
    prompt = tokenizer.chat_prompt_ids(
        [Message("user", "what is port in net ?")], FileTreeEnvironment().tools()
    )
    assert tokenizer.hf.decode(prompt) == (
        "<|im_start|>system\ntools: ls cat submit<|im_end|>\n<|im_start|>user\nwhat is port in net ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_an_episode_is_what_the_template_renders_for_the_whole_chat() -> None:
    tokenizer = HFChatTokenizer(hf_tokenizer())
    env = FileTreeEnvironment()
    task = generate_tasks(0, 1, "train")[0]
    path = next(p for p in task.files if p.rsplit(".", 1)[0] == task.section)
    generate = Replies(tokenizer, ["ls", f"cat {path}", f"submit {task.answer}"])
    trajectory = await run_episode(
        generate, env, task, tokenizer, SAMPLING, 6, 512, 3, max_observation_tokens=64
    )
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("submitted", 1.0, 3)
    ls, cat, _ = generate.texts
    chat = [
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": ls},
        {"role": "tool", "content": " ".join(sorted(task.files))},
        {"role": "assistant", "content": cat},
        {"role": "tool", "content": task.files[path]},
    ]
    tools = [tool.schema() for tool in env.tools()]
    whole = tokenizer.hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    context = trajectory.prompt_ids + trajectory.tokens
    # everything up to the last reply, as the template renders it (the last reply, submit, ends it)
    assert context[: len(whole)] == whole
    # the model's tokens are loss-masked in, the template's tokens out
    generated = [t for t, m in zip(trajectory.tokens, trajectory.loss_mask, strict=True) if m]
    assert tokenizer.hf.decode(generated) == "".join(f"{text}<|im_end|>" for text in generate.texts)


def test_an_observation_is_cut_to_max_tokens() -> None:
    tokenizer = HFChatTokenizer(hf_tokenizer())
    full = tokenizer.observation_ids("tool", "port 42 host 7")
    cut = tokenizer.observation_ids("tool", "port 42 host 7", max_tokens=3)
    assert (
        tokenizer.hf.decode(full) == "\n<|im_start|>tool\nport 42 host 7<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.hf.decode(cut) == "\n<|im_start|>tool\nport 42<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_history_or_is_missing_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"model\.tokenizer: the tokenizer has no chat template; set model\.chatTemplate"
    ):
        HFChatTokenizer(hf_tokenizer(template=None))
    # a template that renders only the last two messages cannot be appended to
    rewriting = CHATML.replace("for m in messages", "for m in messages[-2:]")
    tokenizer = HFChatTokenizer(hf_tokenizer(), chat_template=rewriting)
    with pytest.raises(ValueError, match="renders earlier turns differently once a tool turn follows"):
        tokenizer.observation_ids("tool", "port 42")


def test_the_rollout_loads_a_directory_as_the_models_tokenizer(tmp_path: Path) -> None:
    hf_tokenizer(template=None).save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"has no chat template; set model\.chatTemplate"):
        load_chat_tokenizer(tmp_path / "model", None, None, "filetree")
    loaded = load_chat_tokenizer(tmp_path / "model", CHATML, None, "filetree")
    assert isinstance(loaded, HFChatTokenizer) and loaded.end_id == loaded.hf.convert_tokens_to_ids(
        "<|im_end|>"
    )
    # a directory with mixrl's word tokenizer (a cached tiny model) stays the word tokenizer
    Tokenizer.filetree().save(tmp_path / "tiny.json")
    (tmp_path / "tiny").mkdir()
    Tokenizer.filetree().save(tmp_path / "tiny" / "tokenizer.json")
    assert load_chat_tokenizer(tmp_path / "tiny", None, None, "filetree") == Tokenizer.filetree()
    with pytest.raises(ValueError, match=r"model\.chatTemplate: .* is mixrl's word tokenizer"):
        load_chat_tokenizer(tmp_path / "tiny.json", CHATML, None, "filetree")
    with pytest.raises(ValueError, match=r"--tokenizer: my\.env:E has no word vocabulary"):
        load_chat_tokenizer(None, None, None, "my.env:E")
    assert json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())  # a real HF directory


def test_the_worker_reads_the_models_own_tokenizer_unless_told_otherwise() -> None:
    from mixrl.rl.rollout.worker import tokenizer_location

    from .test_worker import resolved_run

    tiny = resolved_run()
    assert tokenizer_location(tiny, None) is None  # the word tokenizer over the environment's words
    assert tokenizer_location(tiny, "/x/tokenizer.json") == "/x/tokenizer.json"
    real = tiny.model_copy(update={"model": tiny.model.model_copy(update={"path": "/models/qwen3-8b"})})
    assert tokenizer_location(real, None) == "/models/qwen3-8b"  # what the operator's pods read
    own = real.model_copy(update={"model": real.model.model_copy(update={"tokenizer": "/models/tok"})})
    assert tokenizer_location(own, None) == "/models/tok"


def test_the_operators_rollout_pods_can_read_the_models_tokenizer() -> None:
    """In the cluster the worker reads model.path (examples/rlrun-minimal.yaml: on the weights
    volume), so its pods mount that volume, read-only."""
    from mixrl.api.loader import load_rlrun
    from mixrl.api.resolve import resolve
    from mixrl.operator.builders.objects import BuildOptions, Owner
    from mixrl.operator.builders.resources import run_objects

    resolved = resolve(load_rlrun(Path(__file__).parents[2] / "examples" / "rlrun-minimal.yaml"))
    objects = run_objects(
        resolved, Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "uid"), BuildOptions()
    )
    (rollout,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-rollout")
    ]
    pod = rollout["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert resolved.model.path.startswith("/weights/")
    assert mounts["/weights"]["readOnly"] is True
    (claim,) = [v["persistentVolumeClaim"] for v in pod["volumes"] if v["name"] == mounts["/weights"]["name"]]
    assert claim == {"claimName": f"{resolved.name}-weights", "readOnly": True}
    assert "--tokenizer" not in container["command"] + container.get("args", [])
