"""vSurge operator: reconciles ``InferenceModel`` resources into TPU (or CPU) serving pods.

The core is pure (``tpu``, ``spec``, ``validation``, ``manifests``, ``autoscaler``, ``status``,
``drift``); ``kube`` talks to the API server; ``reconcile`` and ``scaling`` orchestrate one pass;
``handlers`` wires those passes into kopf; ``__main__`` is the command line.
"""

__version__ = "0.1.0"
