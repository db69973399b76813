# cython: language_level=3
"""coordkit's public Cython surface: what a host's own Cython code may cimport.

An engine loop written in Cython, say, reads and writes coordkit's frames
with the same C code the coordinator runs, without a Python object per
message::

    from coordkit cimport bind_libzmq, ck_read_submit, ck_submit, zmq_msg_t
    # a vendored copy: from hoststack._vendor.coordkit cimport ...

    bind_libzmq()  # once, at the module's import

The module is built as coordkit's own are, with ``_build.extension`` (the
package directory on the include path for ``includes/*.h``, ``-ldl`` on
Linux); its import imports ``coordkit._codec_c``, whose functions it calls.
What is public is what this file declares, and nothing else: every other
``.pxd`` and header under ``coordkit/`` may change in any release.

* **The header codec** (``_codec_c.pxd`` documents each function): reads of a
  metadata frame in ``buf[0:n]`` returning a ``ck_status`` (``CK_OK`` or a
  negative error that ``ck_strstatus`` names), and writers into a caller's
  buffer of the size the ``CK_*_MAX`` constants (or ``ck_submit_size``,
  ``ck_single_submit_size``) give. ``ck_write_int`` and ``ck_write_uint``
  write an int in msgpack's smallest form and need ``CK_INT_MAX`` bytes of
  room whatever the int; ``ck_read_int`` and ``ck_read_array`` read at a
  ``ck_cursor``. None holds a Python object or needs the GIL.
* **The wire's header values**, ``HEADER_*`` (``protocol.Header``), and
  ``BLOCK_HASH_SIZE``, ``MAX_PARTS``, ``COPY_BELOW``.
* **The frame helpers**: libzmq's message and poll functions under their own
  names, bound at import to the libzmq pyzmq loaded (``bind_libzmq``, which
  every module that cimports this calls once, and ``libzmq_candidates``, the
  paths it tries); ``recv_parts``, every frame of the next message into a
  growable array of messages (``reserve_msgs`` grows one);
  ``ck_msg_from_object``, a frame from any Python buffer
  (copied below ``copy_below`` bytes, sent without a copy above it), whose
  pins ``ck_pins_sweep`` releases, with the GIL, at each send and receive.
  Sockets stay pyzmq's: take the raw handle from ``socket.underlying``.
"""

from ._codec_c cimport (
    CK_ARRAY_MAX,
    CK_BAD_HEADER,
    CK_BAD_LENGTH,
    CK_BAD_REQUEST_ID,
    CK_BAD_TOKEN,
    CK_BAD_TYPE,
    CK_BATCH_HEAD_MAX,
    CK_HEADER_INT_MAX,
    CK_HEADER_MAX,
    CK_INT_MAX,
    CK_NO_REQUEST_ID,
    CK_NOT_MAP,
    CK_OK,
    CK_PROMPT_STR,
    CK_QOS_RANGE,
    CK_QOS_WIDTH,
    CK_RANGE,
    CK_RESERVED,
    CK_RID_RANGE,
    CK_SINGLE_PREFIX_MAX,
    CK_SUBMIT_PREFIX_MAX,
    CK_TOO_DEEP,
    CK_TOO_MANY,
    CK_TRAILING,
    CK_TRUNCATED,
    ck_batch_entry,
    ck_check_map,
    ck_check_prompt,
    ck_entry,
    ck_prompt_hashes,
    ck_prompt_tokens,
    ck_qos,
    ck_read_array,
    ck_read_batch_into,
    ck_read_header,
    ck_read_header_int,
    ck_read_int,
    ck_read_qos,
    ck_read_reply,
    ck_read_reply_batch,
    ck_read_single_head,
    ck_read_single_reply,
    ck_read_single_submit,
    ck_read_submit,
    ck_read_submit_batch,
    ck_single_entry,
    ck_single_submit,
    ck_single_submit_size,
    ck_status,
    ck_strstatus,
    ck_submit,
    ck_submit_size,
    ck_write_array,
    ck_write_batch_head,
    ck_write_header,
    ck_write_header_int,
    ck_write_single_submit,
    ck_write_submit,
)
from ._constants cimport (
    BLOCK_HASH_SIZE,
    COPY_BELOW,
    HEADER_ABORT_REQUEST,
    HEADER_CONNECT,
    HEADER_CONNECT_ACK,
    HEADER_DISCONNECT,
    HEADER_ENGINE_HELLO,
    HEADER_ENGINE_REPLY,
    HEADER_ENGINE_REPLY_PARTIAL,
    HEADER_ERROR,
    HEADER_HEARTBEAT,
    HEADER_PAUSE,
    HEADER_RELEASE_KV,
    HEADER_REPLY_BATCH,
    HEADER_RESUME,
    HEADER_SET_GENERATION_EPOCH,
    HEADER_SHUTDOWN,
    HEADER_START_CUDA_PROFILER,
    HEADER_STATS,
    HEADER_STATS_REPLY,
    HEADER_STOP,
    HEADER_STOP_CUDA_PROFILER,
    HEADER_SUBMIT_BATCH,
    HEADER_SUBMIT_REQUEST,
    HEADER_SUBMIT_REQUEST_WITH_KV,
    HEADER_SUSPEND,
    HEADER_UNPAUSE,
    MAX_PARTS,
)
from .includes.cursor cimport ck_cursor, ck_write_int, ck_write_uint
from .includes.libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_EVENTS,
    ZMQ_POLLIN,
    ZMQ_POLLOUT,
    ZMQ_SNDMORE,
    bind_libzmq,
    libzmq_candidates,
    recv_parts,
    reserve_msgs,
    zmq_errno,
    zmq_free_fn,
    zmq_getsockopt,
    zmq_msg_close,
    zmq_msg_copy,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_data,
    zmq_msg_init_size,
    zmq_msg_more,
    zmq_msg_move,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_poll,
    zmq_pollitem_t,
    zmq_strerror,
)
from .includes.pins cimport ck_msg_from_object, ck_pins_sweep
