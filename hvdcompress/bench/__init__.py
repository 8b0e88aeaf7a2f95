"""The benchmark harness: gradient compressors vs dense Horovod on an emulated network.

``hvdcompress bench`` (or ``python -m hvdcompress.bench``) builds one network namespace per
worker with a rate-limited link into a bridge (``netns``), launches Horovod Gloo workers there
without horovodrun (``rendezvous``, ``launch``; the worker itself is ``hvdcompress.bench.torch_worker``, or
``tf_worker`` with ``--framework tf``),
turns their timings and byte counts into figures (``figures``) and writes JSON, a markdown table
and a chart (``report``). ``cli`` holds the command line. Nothing here imports torch or TensorFlow.
"""



def main(*args, **kwargs):
    """``hvdcompress.bench.cli.main`` (imported on call: the harness's launcher needs Horovod, the
    models and data helpers in this package do not)."""
    from .cli import main as cli_main
    return cli_main(*args, **kwargs)


__all__ = ["main"]
