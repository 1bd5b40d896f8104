"""The vLLM APIs beyond chat and completions, as the gateway routes them.

- ``responses.py``: OpenAI's Responses API (``/v1/responses``), with ``previous_response_id``
  sent back to the replica that stored the previous response (``gateway/response_affinity.py``).
- ``anthropic.py``: Anthropic's Messages API (``/v1/messages``), errors in Anthropic's envelope.
- ``pooling.py``: embeddings (routed by load; no prompt blocks to match) and tokenize/detokenize.
- ``usage.py``: each API's usage object in the chat shape the account phase reads.

``docs/api.md`` lists every endpoint and how it is routed.
"""
