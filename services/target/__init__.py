"""specsplit.services.target"""
