"""The coordinator's tokenizer from the target's model folder: the folder's own where it has one, none (token-id
prompts only) where it holds weights and a config alone, as the workers themselves serve such a folder."""

from transformers import LlamaConfig

from specsplit.services.coordinator.process import worker_tokenizer
from tiny_models import build_model, save_model


def test_a_folder_with_a_tokenizer_gives_it(tmp_path):
    folder = save_model(build_model("qwen2"), tmp_path / "model")
    assert worker_tokenizer(str(folder)).decode(worker_tokenizer(str(folder)).encode("abc")) == "abc"


def test_a_folder_without_one_gives_none_instead_of_failing_the_start(tmp_path):
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)  # transformers cannot build Llama's tokenizer here
    assert worker_tokenizer(str(tmp_path)) is None
