"""The collector: read the device's tensors (dump directories or live runs), splice them, stream them to the
analyzer."""
