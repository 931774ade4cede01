"""Workers in processes of their own (`kvfence worker`) and the front end that drives them
(`kvfence serve --discovery`): the control protocol between a scheduler and a worker, its two ends
(the scheduler's client, the worker's server), the worker process, and how a front end finds its
workers (static addresses, or etcd membership)."""
