"""What a token budget reserves up front for APIs whose prompt the gateway does not count
whole: every prompt of a completions batch, the whole input of embeddings and pooling."""

from __future__ import annotations

from gateway.apis.kinds import EMBEDDINGS, POOLING
from gateway.request.kinds import COMPLETION, estimated_input_tokens


def test_a_batch_reserves_its_other_prompts_too() -> None:
    assert COMPLETION.budget_prompt is not None
    batch = {"model": "m", "prompt": ["a" * 40, "b" * 400, "c" * 4000]}
    # The first prompt as routed (10 tokens), the others estimated at 4 characters a token.
    assert COMPLETION.budget_prompt(batch, 10) == 10 + 100 + 1000
    ids = {"model": "m", "prompt": [[1, 2, 3], [4, 5, 6, 7, 8]]}
    assert COMPLETION.budget_prompt(ids, 3) == 3 + 5
    single = {"model": "m", "prompt": "x" * 400}
    assert COMPLETION.budget_prompt(single, 100) == 100
    one_token_list = {"model": "m", "prompt": [1, 2, 3]}
    assert COMPLETION.budget_prompt(one_token_list, 3) == 3


def test_embeddings_and_pooling_reserve_their_whole_input() -> None:
    inputs = {"model": "a-model-name-that-is-not-input", "input": ["x" * 400] * 100,
              "encoding_format": "base64"}
    assert EMBEDDINGS.budget_prompt is not None
    assert EMBEDDINGS.budget_prompt(inputs, 0) == 100 * 100
    rerank = POOLING["/v1/rerank"]
    assert rerank.budget_prompt is not None
    body = {"model": "m", "query": "q" * 40, "documents": ["d" * 400, "e" * 400]}
    assert rerank.budget_prompt(body, 0) == 10 + 100 + 100


def test_token_ids_count_one_each_and_settings_nothing() -> None:
    assert estimated_input_tokens({"input": [[1, 2, 3], [4, 5]], "dimensions": 512}) == 5
    assert estimated_input_tokens({"input": "", "truncate_prompt_tokens": 10}) == 0


def test_media_is_left_to_the_engines_count() -> None:
    # The diff review: an inline image read as ~75,000 tokens of text, over a whole budget.
    image = "data:image/png;base64," + "A" * 300_000
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 40},
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]}]}
    # The text (10) and the parts' own small strings ("user", "text", "image_url"): no media.
    assert estimated_input_tokens(body) == 10 + 1 + 1 + 3 + 3
