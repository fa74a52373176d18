"""vLLM, as the tools use it. Modules (each imports only the ones above it in this list):

* ``dependencies``  every vLLM member and field the plug-in overrides or reads
* ``fingerprints``  what each release in the window gives for them (generated)
* ``drift``         ``python -m kvbridge.tools.vllm.drift``: a vLLM against the fingerprints
* ``launch``        a real vLLM server with the plug-in, as a child process
* ``demo``          ``kvbridge demo --engine vllm``
"""
