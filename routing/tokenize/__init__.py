"""The tokenization front: request body -> what vLLM would tokenize (docs/hashing.md).

``LocalTokenizer`` loads the model's tokenizer and chat template; ``RemoteTokenizer`` asks a vLLM
server's ``/tokenize``; ``TextTokenizer`` is the approximate, tokenizer-free mode.
"""

from routing.tokenize.chat_template import ChatTemplate
from routing.tokenize.errors import InvalidMessages, TokenizationError
from routing.tokenize.factory import TokenizerKind, build_tokenizer
from routing.tokenize.local import LocalTokenizer
from routing.tokenize.remote import RemoteTokenizer
from routing.tokenize.text import TextTokenizer, flatten_messages

__all__ = [
    "ChatTemplate",
    "InvalidMessages",
    "LocalTokenizer",
    "RemoteTokenizer",
    "TextTokenizer",
    "TokenizationError",
    "TokenizerKind",
    "build_tokenizer",
    "flatten_messages",
]
