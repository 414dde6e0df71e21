"""Weight sync: how the learners' weights reach the runners' engines, both sides of it.

- transports.py: the runners' side (`ObjectStoreTransport`, `NativeTransport`), what both
  sides exchange (`BroadcastWeights`) and check (`weight_layout`, `check_weight_layout`);
- sender.py: the learners' side of the native path (`NativeWeightSender`), and
  learner_sync.py what a learner keeps of it (`LearnerWeightSync`: connect, send, reconnect);
- gloo.py: vLLM's weight-transfer API over gloo (backend "m2po_gloo");
- vllm_worker.py: the code vLLM's worker processes run (the object-store path's extension).

The learner (torch/) and the runners (rollout/) both import this room; it imports neither.
"""
