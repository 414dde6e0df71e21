"""What travels between processes: rollout batches (runners -> driver -> learners) and
published weights (learner -> runners). Neutral: no RLlib classes."""
