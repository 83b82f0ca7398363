"""The embedded default configuration of ``pdlink serve``.

Used when no configuration file is found (no ``--config``, no ``MIES_CONFIG_JSON_PATH``, no
``MINDIE_LLM_HOME_PATH`` / ``MIES_INSTALL_PATH`` home): a newcomer can run ``pdlink serve`` and
talk to it at once. It is deliberately local and unauthenticated:

* the management plane on ``http://127.0.0.1:1026`` and ``/metrics`` on ``http://127.0.0.1:1027``,
  **plain HTTP** (``httpsEnabled: false``): only acceptable because both bind to loopback; any
  other deployment must use its own file with ``httpsEnabled: true`` and certificates;
* ``inferMode: "dmi"`` (PD disaggregation: the role endpoints are live);
* one CPU-backend engine (``deviceCount: 1``); its KV listener, once the role needs one, binds
  the instance's ``server_ip`` from the role request at port ``26000 + device_id``;
* links not authenticated unless env ``PDLINK_LINK_SECRET`` is set (``linkSecretFile`` is absent);
* the test KV surface off.

``pdlink serve --print-default-config`` prints it; docs/server.md documents every field.
"""

DEFAULT_CONFIG_JSON = """\
{
  "Version": "1.0.0",
  "ServerConfig": {
    "ipAddress": "127.0.0.1",
    "managementIpAddress": "127.0.0.1",
    "port": 1025,
    "managementPort": 1026,
    "metricsPort": 1027,
    "allowAllZeroIpListening": false,
    "maxLinkNum": 1000,
    "httpsEnabled": false,
    "inferMode": "dmi",
    "maxRequestLength": 40,
    "maxLinksPerClient": 16,
    "headTimeoutMs": 10000,
    "bodyTimeoutMs": 60000,
    "maxJsonDepth": 32,
    "tlsCaPath": "security/ca/",
    "tlsCaFile": ["ca.pem"],
    "tlsCert": "security/certs/server.pem",
    "tlsPk": "security/keys/server.key.pem",
    "tlsCrlPath": "security/certs/",
    "tlsCrlFiles": [],
    "managementTlsCaFile": ["management_ca.pem"],
    "managementTlsCert": "security/certs/management/server.pem",
    "managementTlsPk": "security/keys/management/server.key.pem",
    "managementTlsCrlPath": "security/management/certs/",
    "managementTlsCrlFiles": [],
    "metricsTlsCaFile": ["metrics_ca.pem"],
    "metricsTlsCert": "security/certs/metrics/server.pem",
    "metricsTlsPk": "security/keys/metrics/server.key.pem",
    "metricsTlsCrlPath": "security/metrics/certs/",
    "metricsTlsCrlFiles": []
  },
  "BackendConfig": {
    "ModelDeployConfig": {
      "maxSeqLen": 2560,
      "ModelConfig": [{"modelName": "pdlink", "worldSize": 1, "npuMemSize": -1, "cpuMemSize": 5}]
    },
    "ScheduleConfig": {"cacheBlockSize": 128, "maxIterTimes": 512, "maxBatchSize": 200}
  },
  "KvTransferConfig": {
    "backend": "cpu",
    "transport": "auto",
    "deviceCount": 1,
    "listenIpSource": "server_ip",
    "listenPortBase": 26000,
    "linkTimeoutMs": 3000,
    "linkTotalTimeMs": 30000,
    "linkRetryIntervalMs": 200,
    "syncKvTimeoutMs": 1000,
    "roleDrainTimeoutMs": 120000,
    "testKv": {"enabled": false, "numTensors": 2, "numBlocks": 16, "blockBytes": 4096}
  }
}
"""
