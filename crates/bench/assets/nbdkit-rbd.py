# An nbdkit plugin exporting one Ceph RBD image over NBD, so the bench can
# drive Ceph through the same protocol path as CoronaFS (Debian's qemu-nbd
# lacks the rbd block driver here, and rbd-nbd needs the kernel NBD client).
#
#   nbdkit python nbdkit-rbd.py conf=/path/ceph.conf pool=rbd image=img
#
# Requests run in parallel (librbd releases the GIL during I/O); each
# request still costs some Python, which the bench's report says.
import nbdkit
import rados
import rbd

API_VERSION = 2

_conf = None
_pool = None
_image = None
_cluster = None
_ioctx = None


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def config(key, value):
    global _conf, _pool, _image
    if key == "conf":
        _conf = value
    elif key == "pool":
        _pool = value
    elif key == "image":
        _image = value
    else:
        raise RuntimeError("unknown parameter %s (conf, pool, image)" % key)


def config_complete():
    if not (_conf and _pool and _image):
        raise RuntimeError("conf=, pool= and image= are required")


def get_ready():
    global _cluster, _ioctx
    _cluster = rados.Rados(conffile=_conf)
    _cluster.connect(timeout=20)
    _ioctx = _cluster.open_ioctx(_pool)


def open(readonly):
    return rbd.Image(_ioctx, _image, read_only=readonly)


def close(h):
    h.close()


def get_size(h):
    return h.size()


def can_multi_conn(h):
    return True


def can_flush(h):
    return True


def pread(h, buf, offset, flags):
    data = h.read(offset, len(buf))
    buf[: len(data)] = data
    if len(data) < len(buf):
        buf[len(data):] = bytes(len(buf) - len(data))


def pwrite(h, buf, offset, flags):
    h.write(bytes(buf), offset)
    if flags & nbdkit.FLAG_FUA:
        h.flush()


def flush(h, flags):
    h.flush()
