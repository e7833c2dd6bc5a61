"""kvstage's own vLLM KV connector: vLLM's public ``KVConnectorBase_V1`` onto pd/'s roles.

``"kv_connector": "KVStageConnector", "kv_connector_module_path":
"kvstage.integrations.vllm.native"``. Importing this package imports vLLM.
"""

from kvstage.integrations.vllm.native.connector import KVStageConnector

__all__ = ["KVStageConnector"]
