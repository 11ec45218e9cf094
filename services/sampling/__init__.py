"""specsplit.services.sampling"""
