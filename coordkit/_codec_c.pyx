# cython: language_level=3, embedsignature=True
"""The header codec, unrolled by hand over a byte pointer and a length.

The twin of :mod:`coordkit._codec_py`: same functions, byte-identical results,
:class:`~coordkit.protocol.ProtocolError` for the same inputs. The ``ck_*``
functions are the C-level API declared in ``_codec_c.pxd`` for the Cython
modules (and, through ``__init__.pxd``, a host's own); the Python functions
are thin wrappers over them, so the tests exercise the code the coordinator
runs.

It is laid out by part, as ``_codec_py.py`` is, in the same order:

* ``codec/reader.pyx``: the reads every part is made of -- the status texts,
  an array head, an int, a bool, the structural skip of any object -- and the
  Python API's buffer and error helpers;
* ``codec/multipart.pyx``: the metadata frames of the multipart protocol
  (a SUBMIT's head, an engine's reply batch, ``[h, int]``, the batches of
  coordkit's own endpoints) and a prompt frame's size in tokens;
* ``codec/single_frame.pyx``: Megatron-Core 0.19's single frames, read as
  byte spans, and the block hashes of a token-id prompt;
* ``codec/writer.pyx``: the frames the coordinator and the endpoints write;
* ``codec/kvevents.pyx``: the engines' KV-event batches read into the index's
  records (``_kvevents.decode_batch`` in C).

Every read goes through the bounds-checked cursor of ``includes/cursor.h``,
and every length read from the data is checked against the bytes left
before it is used.
"""

from ._constants cimport generated_constants

from ._shared import check_constants

check_constants(generated_constants())

__all__ = [
    # multipart
    "read_header",
    "read_submit",
    "read_qos",
    "read_reply",
    "prompt_tokens",
    "read_header_int",
    "read_rids",
    "read_submit_batch",
    "read_reply_batch",
    "read_handoff",
    # single frame
    "read_single_head",
    "read_single_submit",
    "read_single_reply",
    "check_prompt",
    "check_map",
    "prompt_hashes",
    "streamed_tokens",
    "NO_TOKENS",
    "NEW_TOKENS",
    "ALL_TOKENS",
    # writer
    "write_submit",
    "write_header_int",
    "write_single_submit",
    # the engines' KV events
    "decode_kv_batch",
    "KVChains",
]

include "codec/reader.pyx"
include "codec/multipart.pyx"
include "codec/single_frame.pyx"
include "codec/writer.pyx"
include "codec/kvevents.pyx"
include "codec/kvchains.pyx"

NO_TOKENS, NEW_TOKENS, ALL_TOKENS = CK_NO_TOKENS, CK_NEW_TOKENS, CK_ALL_TOKENS
