"""`longstraw export` (longstraw/export.py): a DCP template checkpoint and a `longstraw
train` checkpoint to an HF folder whose `from_pretrained` log-probs equal the training
process's model's (float64, 1e-12)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from longstraw import cli
from longstraw.integrations.chat import token_id_tokenizer
from longstraw.tiny import tiny_model
from longstraw.train import TrainConfig, _save
from longstraw.warm import build_model

VOCAB, POSITIONS = 97, 128


def _perturb(model, seed=1):
    """Weights no fresh build has: what training would have left."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids[None]).logits.double(), -1)[0]


def test_dcp_template_checkpoint_exports_to_from_pretrained(tmp_path, capsys):
    model = _perturb(tiny_model("qwen3", dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=POSITIONS))
    dcp.save({"model": model.state_dict(), "step": torch.tensor(3)}, checkpoint_id=str(tmp_path / "step-3"))
    token_id_tokenizer(VOCAB, eos_token_id=1).save_pretrained(tmp_path / "tok")
    assert cli.main(["export", str(tmp_path / "step-3"), str(tmp_path / "hf"), "--model", "tiny:qwen3",
                     "--max-position-embeddings", str(POSITIONS), "--tokenizer", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    assert loaded.dtype == torch.float64 and loaded.config.max_position_embeddings == POSITIONS
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(model.eval(), ids), rtol=0, atol=1e-12)


def test_train_loop_checkpoint_exports_without_model_flag(tmp_path):
    cfg = TrainConfig(model="dense", dtype="float64", out_dir=str(tmp_path / "run"))
    model = _perturb(build_model(cfg))
    (tmp_path / "run").mkdir()
    _save(str(tmp_path / "run" / "checkpoint.pt"), model, torch.optim.SGD(model.parameters(), lr=0.1), 5, cfg,
          {"in_row": 0, "total": 0})
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(model.eval(), ids), rtol=0, atol=1e-12)


def test_bad_checkpoints_are_errors_before_writing(tmp_path, capsys):
    model = tiny_model("qwen3", dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=POSITIONS)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-1"))
    assert cli.main(["export", str(tmp_path / "step-1"), str(tmp_path / "hf")]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "step-1"), str(tmp_path / "hf"), "--model", "tiny:qwen3_5"]) == 2
    assert "architecture" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert cli.main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 2
    assert "neither a DCP checkpoint" in capsys.readouterr().err


def test_lora_adapter_exports_as_adapter_and_merged(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3", dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=POSITIONS)
    base.save_pretrained(tmp_path / "base")
    token_id_tokenizer(VOCAB, eos_token_id=1).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa")  # the adapter names it
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))
    _perturb(lora)  # the adapter trained (B no longer zero), the base moved too: only the adapter is saved
    lora.save_pretrained(tmp_path / "adapter")
    trained = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype="auto").eval()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    want = _logprobs(trained, ids)
    assert cli.main(["export", str(tmp_path / "adapter"), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    torch.testing.assert_close(_logprobs(merged, ids), want, rtol=0, atol=1e-12)
    assert not torch.allclose(_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ids), want)
    assert cli.main(["export", str(tmp_path / "adapter"), str(tmp_path / "again")]) == 0
    again = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "again", dtype="auto").eval()
    torch.testing.assert_close(_logprobs(again, ids), want, rtol=0, atol=1e-12)


@pytest.mark.slow  # a torchrun launch of the template, ~25 s on 2 loaded cores
def test_a_template_run_exports_to_the_model_it_trained(tmp_path):
    """examples/torchrun_grpo.py trains 2 steps (float64, exact) and writes its DCP step-2
    and (`--dump`) the weights its process holds at the end; the export's `from_pretrained`
    log-probs equal those weights' to 1e-12."""
    from longstraw.tasks import KVRecall, Vocab
    from tests.test_example_torchrun import _torchrun

    _torchrun(1, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--dump", str(tmp_path / "trained.pt"))
    vocab = KVRecall(48, num_facts=2, vocab=Vocab(num_values=2, num_keys=2, num_filler=2)).vocab
    trained = tiny_model("qwen3", dtype=torch.float64, vocab_size=vocab.size, max_position_embeddings=48 + 64)
    initial = {n: p.detach().clone() for n, p in trained.named_parameters()}
    trained.load_state_dict(torch.load(tmp_path / "trained.pt", weights_only=True), strict=False)
    assert any(not torch.equal(p, initial[n]) for n, p in trained.named_parameters()), "the run trained"
    assert cli.main(["export", str(tmp_path / "ck" / "step-2"), str(tmp_path / "hf"), "--model", "tiny:qwen3",
                     "--max-position-embeddings", str(48 + 64)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    ids = torch.randint(0, vocab.size, (40,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(trained.eval(), ids), rtol=0, atol=1e-12)


@pytest.mark.slow  # two grpo steps and two exports, 20 s on 2 loaded cores
def test_a_grpo_lora_run_exports_to_the_model_it_trained(tmp_path, monkeypatch):
    """`longstraw grpo --use_peft` trains 2 steps (float64) and writes checkpoint-2 (an
    adapter folder); exported merged and as an adapter, `from_pretrained` log-probs equal
    the training process's PEFT model's to 1e-12."""
    pytest.importorskip("peft")
    import json

    from longstraw import grpo_cli
    from longstraw.integrations.trl import LongStrawGRPOTrainer
    from tests.test_grpo_cli import _flags

    trainers = []

    class Kept(LongStrawGRPOTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)

    monkeypatch.setattr(grpo_cli, "LongStrawGRPOTrainer", Kept)
    tiny_model("qwen3", dtype=torch.float64, max_position_embeddings=64, vocab_size=VOCAB).save_pretrained(
        tmp_path / "model")
    token_id_tokenizer(VOCAB, eos_token_id=1).save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(str(int(t)) for t in torch.randint(2, VOCAB, (9,), generator=g))}) + "\n"
        for _ in range(4)))
    (tmp_path / "rewards.py").write_text("def even_tokens(completion_ids, **kwargs):\n"
                                         "    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in "
                                         "completion_ids]\n")
    assert cli.main(_flags(tmp_path, "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj",
                           "--dtype", "auto", steps=2)) == 0
    model = trainers[0].model.eval()
    assert next(model.parameters()).dtype == torch.float64
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    want = _logprobs(model, ids)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="sdpa")
    assert not torch.allclose(_logprobs(base, ids), want), "the adapter trained"
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert cli.main(["export", str(checkpoint), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa")
    torch.testing.assert_close(_logprobs(merged, ids), want, rtol=0, atol=1e-12)
    assert cli.main(["export", str(checkpoint), str(tmp_path / "adapter")]) == 0
    peft = pytest.importorskip("peft")
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype="auto").eval()
    torch.testing.assert_close(_logprobs(adapter, ids), want, rtol=0, atol=1e-12)
