"""Recorded fingerprints of the vLLM members the plug-in depends on, one entry per
supported vLLM minor version (see kvbridge/vllm/drift.py; docs/vllm.md, "The next vLLM").

Written by ``python -m kvbridge.vllm.drift [--wheel PATH] --write``: do not edit by hand.
None: the member does not exist in that version.
"""

from __future__ import annotations

FINGERPRINTS: dict[str, dict[str, str | None]] = {
    "0.32": {
        "NixlPullConnector.__init__": "8d2944bac31d9798",
        "NixlBaseConnector.__init__": "3aa8a1fdf06b17c4",
        "NixlBaseConnector.set_xfer_handshake_metadata_pp_aware": "8456382fbeceb5eb",
        "NixlPullConnector.supports_sleep_mode": None,
        "NixlBaseConnectorScheduler.__init__": "5abbbde3d3a1dcc2",
        "NixlBaseConnectorScheduler.set_xfer_handshake_metadata": "fe1871138c1a642c",
        "NixlBaseConnectorScheduler._nixl_handshake_listener": "df4046d0a6dbf165",
        "NixlBaseConnectorScheduler.shutdown": "3e032b98ebb2bcfe",
        "NixlPullConnectorScheduler.request_finished": "02d652e37c1b1ef5",
        "NixlBaseConnectorWorker._nixl_handshake": "abc5219ef1d00569",
        "NixlBaseConnectorWorker._ensure_handshake": "8894a872dd8bc0e3",
        "NixlBaseConnectorWorker._validate_remote_parallel_config": "1442f43b8d515be7",
        "NixlBaseConnectorWorker._validate_csa_linear_tp_layout": "492fddadcf32b31b",
        "NixlBaseConnectorWorker.add_remote_agent": "0a17fc44933a3598",
        "NixlBaseConnectorWorker._add_notif_only_remote_agent": "82e89ec49f16cff4",
        "NixlBaseConnectorWorker.shutdown": "df1e68a4b391a282",
        "NixlPullConnectorWorker.__init__": "ffa074879f830284",
        "TransferTopology.handshake_target_ranks": "5eb96f60c0b237bc",
        "NixlPullConnectorScheduler.update_state_after_alloc": "04eb06975fbe0159",
        "NixlBaseConnectorScheduler.build_connector_meta": "958853681032b7ba",
        "NixlBaseConnectorWorker.register_kv_caches": "16687656bee43001",
        "NixlPullConnectorWorker.start_load_kv": "3683f89a3a2dcd4b",
        "NixlBaseConnectorWorker._pop_done_transfers": "6e58e1c81449c1a2",
        "NixlBaseConnectorWorker.get_transfer_results": "0ee831875c883568",
        "NixlBaseConnectorWorker.restore_kv_caches": None,
        "KVConnectorModelRunnerMixin._get_kv_connector_output": "c79ecd68d9f8558c",
        "NixlBaseConnector.wait_for_save": "267a562a440586f0",
        "NixlKVConnectorStats": "2a547270bebf9b07",
        "NixlPromMetrics.observe": "4daad0c05880ccb1",
        "NixlHandshakePayload": "c98972d27809238e",
        "NixlAgentMetadata": "1d379843c4820e39",
    },
    "0.33": {
        "NixlPullConnector.__init__": "8d2944bac31d9798",
        "NixlBaseConnector.__init__": "3aa8a1fdf06b17c4",
        "NixlBaseConnector.set_xfer_handshake_metadata_pp_aware": "8456382fbeceb5eb",
        "NixlPullConnector.supports_sleep_mode": "e30cc30bd1b8d99d",
        "NixlBaseConnectorScheduler.__init__": "2a3f59b80250d6f8",
        "NixlBaseConnectorScheduler.set_xfer_handshake_metadata": "cc4a7db89bf5fc1f",
        "NixlBaseConnectorScheduler._nixl_handshake_listener": "df4046d0a6dbf165",
        "NixlBaseConnectorScheduler.shutdown": "3e032b98ebb2bcfe",
        "NixlPullConnectorScheduler.request_finished": "7466230343871a95",
        "NixlBaseConnectorWorker._nixl_handshake": "abc5219ef1d00569",
        "NixlBaseConnectorWorker._ensure_handshake": "8894a872dd8bc0e3",
        "NixlBaseConnectorWorker._validate_remote_parallel_config": "1442f43b8d515be7",
        "NixlBaseConnectorWorker._validate_csa_linear_tp_layout": "492fddadcf32b31b",
        "NixlBaseConnectorWorker.add_remote_agent": "0a17fc44933a3598",
        "NixlBaseConnectorWorker._add_notif_only_remote_agent": "82e89ec49f16cff4",
        "NixlBaseConnectorWorker.shutdown": "df1e68a4b391a282",
        "NixlPullConnectorWorker.__init__": "ffa074879f830284",
        "TransferTopology.handshake_target_ranks": "5eb96f60c0b237bc",
        "NixlPullConnectorScheduler.update_state_after_alloc": "04eb06975fbe0159",
        "NixlBaseConnectorScheduler.build_connector_meta": "958853681032b7ba",
        "NixlBaseConnectorWorker.register_kv_caches": "81f27163ef7b5849",
        "NixlPullConnectorWorker.start_load_kv": "3683f89a3a2dcd4b",
        "NixlBaseConnectorWorker._pop_done_transfers": "6e58e1c81449c1a2",
        "NixlBaseConnectorWorker.get_transfer_results": "0ee831875c883568",
        "NixlBaseConnectorWorker.restore_kv_caches": "06f5cef11fddb969",
        "KVConnectorModelRunnerMixin._get_kv_connector_output": "c79ecd68d9f8558c",
        "NixlBaseConnector.wait_for_save": "267a562a440586f0",
        "NixlKVConnectorStats": "2a547270bebf9b07",
        "NixlPromMetrics.observe": "4daad0c05880ccb1",
        "NixlHandshakePayload": "c98972d27809238e",
        "NixlAgentMetadata": "1d379843c4820e39",
    },
}

# Functions keyed on the name NixlConnector (path under vllm/:qualname).
NAME_CHECKS: dict[str, dict[str, str]] = {
    "0.32": {
        "config/vllm.py:VllmConfig.__post_init__": "600a34c80b4cfb2c",
        "config/vllm.py:VllmConfig._verify_aux_output_compatibility": "389ea816e8e8c559",
        "config/vllm.py:VllmConfig.adjust_dcp_kv_cache_interleave_size": "b4d117645c9a5ec5",
        "config/vllm.py:VllmConfig.validate_block_size": "3fcaa156606f6687",
        "platforms/cpu.py:CpuPlatform.check_and_update_config": "0bfef5affa0c9a4d",
    },
    "0.33": {
        "config/vllm.py:VllmConfig.__post_init__": "6502980204e35eb0",
        "config/vllm.py:VllmConfig._verify_aux_output_compatibility": "389ea816e8e8c559",
        "config/vllm.py:VllmConfig.adjust_dcp_kv_cache_interleave_size": "b81887eab3a8c3a7",
        "config/vllm.py:VllmConfig.validate_block_size": "3fcaa156606f6687",
        "models/step5/nvidia/model.py:_verify_step5_dsa_kv_transfer_compatibility": "f8379e60853da10c",
        "platforms/cpu.py:CpuPlatform.check_and_update_config": "1149c929a1a99a12",
    },
}
