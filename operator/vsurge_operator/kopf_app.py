"""Entry for kopf's own runner: ``kopf run -m vsurge_operator.kopf_app --all-namespaces``.

Registers the handlers into kopf's default registry with the configuration taken from the environment
(``VSURGE_OPERATOR_*``). ``python -m vsurge_operator`` is the preferred entrypoint.
"""

import kopf

from vsurge_operator import handlers
from vsurge_operator.config import OperatorConfig

handlers.register(kopf.get_default_registry(), OperatorConfig.from_env())
